"""Experimental: kept for research, never a default (docs/benchmarks.md, "Variants").
Importing this package registers its cache policy with the runtime's (the command-line
tools do, edgemoe.cli); the runtime never imports it.

    learned      the learned cache policy (`--cache-policy learned`)
    fit_learned  fitting its weights to replays of routing traces (cache_sim train-learned)
"""

from . import learned  # noqa: F401  (registers --cache-policy learned)
