"""Which mlx-lm model families edgemoe streams, as far as their configs and names say.

What a family is (its MoE blocks call an mlx-lm switch layer with the indices their own
routing chose) is found in mlx-lm's own model: edgemoe.mlx_backend.families builds it and
finds its routed experts, which an mlx-lm checkpoint read in place is opened with
(`FindExperts`, edgemoe.format.inplace). Here is what needs no model: `UNSUPPORTED`, what
is known not to work and why; a config's shape checked by arithmetic; router paths,
layer numbers, and the bytes of a KV cache. No MLX, no mlx-lm.
"""

from pathlib import Path
from typing import Callable, List, Optional, Tuple

# model_type -> why edgemoe cannot stream it (shown by convert and load)
UNSUPPORTED = {
    "dbrx": "mlx-lm computes its experts one at a time, in a Python loop over separate "
            "MLPs, not with a switch layer that a streaming module could replace",
    "muse_spark": "mlx-lm runs it only with Metal kernels, and its MoE block reads its "
                  "expert module's own post-expert norm, which a streaming module does not "
                  "carry: not verified",
}

# (config, where) -> (module paths of the routed-expert modules, in layer order; experts
# per token): a family's routed experts, found in a backend's model classes for the config
# (edgemoe.mlx_backend.families.find_experts: mlx-lm's)
FindExperts = Callable[[dict, Path], Tuple[List[str], int]]


class UnsupportedModelError(ValueError):
    pass


def check_supported(config: dict, where) -> str:
    """The config's model_type, if it is not known to fail, and its shape is one a model
    can have (checked by arithmetic, before anything is built from it). Whether mlx-lm
    runs it is edgemoe.mlx_backend.families.check_runs."""
    from .shape import check_shape

    model_type = config.get("model_type")
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} cannot be streamed: "
                                    f"{UNSUPPORTED[model_type]}")
    check_shape(config, where)
    return model_type


ROUTER_NAMES = ("router", "gate")  # the attribute of a MoE block holding its router


def is_router_path(path: str) -> bool:
    """Whether a module path (`model.layers.3.mlp.gate`) names a router or lies inside one:
    a LoRA there would change the routing."""
    return bool(set(ROUTER_NAMES) & set(path.split(".")))


def layer_index(module_path: str) -> int:
    """The decoder layer of a module path: `model.layers.3.mlp.switch_mlp` -> 3 (the first
    number in the path, whatever the family calls its list of layers)."""
    return int(next(part for part in module_path.split(".") if part.isdigit()))


def text_config(config: dict) -> dict:
    """The language model's config: vision-language wrappers nest it as `text_config`."""
    return {**config, **config.get("text_config", {})}


def kv_bytes_per_token(config: dict, model_args: Optional[dict] = None) -> int:
    """Bytes mlx-lm's KV cache takes per token (keys and values of every layer, in 16-bit
    floats): what a budget must leave room for. An upper bound for hybrid families, whose
    linear-attention layers keep a fixed-size state instead. `model_args`: the config as
    the family's own ModelArgs reads it (its defaults, its key names:
    edgemoe.mlx_backend.families.model_args), under the config's own values."""
    args = {**(model_args or {}), **text_config(config)}
    layers = _first(args, "num_hidden_layers", "num_layers", "n_layers", "n_layer")
    if layers is None:  # nemotron_h: one letter per layer
        layers = len(args.get("hybrid_override_pattern") or args.get("layer_types") or [])
    hidden = _first(args, "hidden_size", "model_dim", "d_model", "n_embd")
    heads = _first(args, "num_attention_heads", "num_heads", "n_heads", "n_head")
    if "kv_lora_rank" in args:  # DeepSeek's MLA, cached as mlx-lm does: per head, expanded
        per_head = args["qk_nope_head_dim"] + args["qk_rope_head_dim"] + args["v_head_dim"]
        return int(layers * heads * per_head * 2)
    kv_heads = _first(args, "num_key_value_heads", "num_kv_heads") or heads
    head_dim = args.get("head_dim") or hidden // heads
    return int(layers * 2 * kv_heads * head_dim * 2)


def _first(args: dict, *names):
    return next((args[n] for n in names if args.get(n) is not None), None)
