"""The MLX model side: mlx-lm's own model classes with streaming expert modules.

    experts     StreamingExperts (mlx-lm's SwitchGLU over the slots), the model-class hooks
    slots       the MLX slot memory: slot arrays in unified memory, filled in place
    loader      `load()`, mlx-lm's `load` with an expert budget and a routing mode
    generation  `generate` / `stream_generate`: mlx-lm's loop plus expert statistics
    lora        the recovery LoRA, served unmerged
"""
