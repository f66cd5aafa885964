"""The MLX backend: mlx-lm's own model classes with streaming expert modules, and the
routing modes run on them (edgemoe.cuda is the PyTorch backend beside it).

    loader       `load()`: the model over a LoadPlan, its slot memory, its routing
    experts      StreamingExperts (mlx-lm's SwitchGLU over the slots), the model-class hooks
    families     a family's routed experts in mlx-lm's own model (an mlx-lm checkpoint's,
                 read in place by either backend)
    slots        the MLX slot memory: slot arrays in unified memory, filled in place
    hostsync     a layer's one host sync
    generation   `generate` / `stream_generate`: mlx-lm's loop plus expert statistics
    lora         the recovery LoRA, served unmerged
    drafts, lookup  speculative decoding's drafts
    prefill      --prefill-arithmetic blas
    gates        a block's routing by its own code from logits; RouterTap (prerouted modes)
    prerouter    the heads that predict the next layer's routing a token ahead
    predictors   a mode's predictor: next-router (advisory), prerouted
    conditional  cache-conditional routing, reduced top-k
    state        routing state of a sequence, kept beside its KV cache
    driver       runs a mode's predictor: the model calls it at each MoE layer
"""
