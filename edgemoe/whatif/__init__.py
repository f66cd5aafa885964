"""What-if questions: what the runtime would do on other traces, budgets, policies or
machines. This package imports the runtime (edgemoe.streaming, edgemoe.format, ...) and
the runtime never imports it (tests/test_layers.py); the tools do (doctor, cache_sim,
and the command line, which offers the learned cache policy).

    replay        routing traces replayed through the store's own slots; Belady's optimum
    questions     a budget shared across layers; speculative windows (cache_sim split, windows)
    experimental  the learned cache policy and its fit to replays (never a default)
    twin          decode and prefill speed as on a named machine (doctor --machine)
"""
