"""Which mlx-lm model families edgemoe streams, and where their routed experts live.

Every supported family's MoE block computes its own routing, then calls its expert
module (`switch_mlp`, an mlx-lm `SwitchGLU`) with the chosen indices. Swapping that
module for a streaming one (edgemoe.model.experts) keeps the family's routing math
exact. This module reads configs only: it needs no MLX.
"""

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "mixtral", "olmoe", "qwen3_moe")


class UnsupportedModelError(ValueError):
    pass


def check_supported(config: dict, where) -> str:
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not a supported MoE family; "
            f"edgemoe supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def layer_index(module_path: str) -> int:
    """`model.layers.3.mlp.switch_mlp` -> 3."""
    parts = module_path.split(".")
    return int(parts[parts.index("layers") + 1])


def top_k(config: dict) -> int:
    return int(config["num_experts_per_tok"])


def kv_bytes_per_token(config: dict) -> int:
    """Bytes mlx-lm's KV cache takes per token (keys and values of every layer, in 16-bit
    floats): what a budget must leave room for."""
    layers = int(config["num_hidden_layers"])
    heads = int(config["num_attention_heads"])
    if "kv_lora_rank" in config:  # DeepSeek's MLA, cached as mlx-lm does: per head, expanded
        per_head = (config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
                    + config["v_head_dim"])
        return layers * heads * per_head * 2
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    return layers * 2 * kv_heads * head_dim * 2
