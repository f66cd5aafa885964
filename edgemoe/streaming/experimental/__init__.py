"""Experimental: kept for research, never a default (docs/benchmarks.md, "Variants").

    learned      the learned cache policy (`--cache-policy learned`)
    fit_learned  fitting its weights to replays of routing traces (cache_sim train-learned)
"""
