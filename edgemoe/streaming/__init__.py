"""Streaming: experts from disk into a fixed pool of memory slots.

    budget     budget -> slots per layer, the minimum, bytes per slot (SlotPlan)
    slots      one layer's slot pool: the state machine (free, filling, ready, in use)
    calls      the call protocol of every routed-expert module: ids -> passes ->
               ensure -> compute -> release (always)
    store      all layers' pools under one budget, one reader: `prefetch`, `snapshot`
    reader     background `preadv` threads that fill slots (O_DIRECT if asked)
    cache      eviction policies: LFU (the default); others register by name
    stats      the counters and the one definition of a hit
    trace      routing and prefetch traces, for edgemoe.cache_sim
    telemetry  peak RSS, page cache held by a file

Backends bring only their slot memory and compute: MLX (edgemoe.mlx_backend.experts) and CUDA
(edgemoe.cuda), and hand the store their slot memory (`ExpertStore(..., memory=)`:
edgemoe.mlx_backend.slots, edgemoe.cuda.slots). Nothing here imports MLX or PyTorch. This is
what decodes; traces replayed through these slots, cache simulation, the learned policy
and the twin are edgemoe.whatif's, which imports this package and is never imported by it.
"""
