"""Which mlx-lm model families edgemoe streams, and where their routed experts live.

A family is supported by capability, not by name: its MoE blocks call an mlx-lm switch
layer (`SwitchGLU` / `SwitchMLP`) with the indices their own routing chose, so swapping
that module for a streaming one (edgemoe.mlx_backend.experts) keeps the family's routing math
exact. The experts are found in mlx-lm's own model, built from the config with its weights
left unmaterialised (`skeleton`). `UNSUPPORTED` lists what is known not to work, and why.
"""

import importlib
from typing import Dict, List, Tuple

# model_type -> why edgemoe cannot stream it (shown by convert and load)
UNSUPPORTED = {
    "dbrx": "mlx-lm computes its experts one at a time, in a Python loop over separate "
            "MLPs, not with a switch layer that a streaming module could replace",
    "muse_spark": "mlx-lm runs it only with Metal kernels, and its MoE block reads its "
                  "expert module's own post-expert norm, which a streaming module does not "
                  "carry: not verified",
}


class UnsupportedModelError(ValueError):
    pass


def check_supported(config: dict, where) -> str:
    """The config's model_type, if mlx-lm runs it, it is not known to fail, and its shape
    is one a model can have (checked by arithmetic, before anything is built from it)."""
    from .shape import check_shape

    model_type = config.get("model_type")
    if model_type in UNSUPPORTED:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} cannot be streamed: "
                                    f"{UNSUPPORTED[model_type]}")
    check_shape(config, where)  # first: arithmetic, before mlx-lm's classes are imported
    try:
        _model_classes(config)
    except ValueError:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not a model "
                                    f"mlx-lm {_mlx_lm_version()} runs") from None
    except ImportError:  # no mlx-lm (the CUDA backend): its own loader checks the family
        pass
    return model_type


def _model_classes(config: dict):
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def _mlx_lm_version() -> str:
    return importlib.import_module("mlx_lm").__version__


def skeleton(config: dict):
    """mlx-lm's model for `config`, its weights never materialised (cheap at any size)."""
    model_class, args_class = _model_classes(config)
    return model_class(args_class.from_dict(config))


def is_routed_experts(module) -> bool:
    """mlx-lm's switch layers, or edgemoe's streaming module that replaces them."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    return isinstance(module, (SwitchGLU, SwitchMLP)) or getattr(module, "routed_experts", False)


ROUTER_NAMES = ("router", "gate")  # the attribute of a MoE block holding its router


def is_router_path(path: str) -> bool:
    """Whether a module path (`model.layers.3.mlp.gate`) names a router or lies inside one:
    a LoRA there would change the routing."""
    return bool(set(ROUTER_NAMES) & set(path.split(".")))


def _has_router(module) -> bool:
    import mlx.nn as nn

    return any(isinstance(module.get(name), nn.Module) for name in ROUTER_NAMES)


def _holds_routed_experts(module) -> bool:
    import mlx.nn as nn

    return isinstance(module, nn.Module) and (
        is_routed_experts(module) or any(is_routed_experts(m) for _, m in module.named_modules()))


def experts_name(block) -> str:
    """The attribute of a MoE block holding its routed-expert module, or the module that
    wraps it (deepseek_v41, gemma4 call a wrapper with the indices and the weights)."""
    return next(name for name, child in block.items() if _holds_routed_experts(child))


def moe_block_paths(model) -> Dict[str, str]:
    """{routed-expert module path: path of its MoE block}: the nearest module around the
    experts that has a router (usually their parent; gemma4's is the decoder layer)."""
    modules = dict(model.named_modules())
    blocks = {}
    for path in (p for p, m in modules.items() if is_routed_experts(m)):
        block = path
        while not (block in modules and block != path and _has_router(modules[block])):
            if "." not in block:
                raise UnsupportedModelError(f"{path}: no module around these routed experts "
                                            f"has a router ({' or '.join(ROUTER_NAMES)})")
            block = block.rsplit(".", 1)[0]
        blocks[path] = block
    return blocks


class _Routed(Exception):
    def __init__(self, indices):
        self.indices = indices


class _IndexCapture:
    """Stands in for an expert module: stops its block there with the indices it routed."""

    def __call__(self, x, indices, *args, **kwargs):
        raise _Routed(indices)


def routed_indices(block, x):
    """The expert ids a MoE block's own code routes its input `x` (B, L, D) to; it stops
    at its expert module, so nothing after it (or unused before it) is computed."""
    name = experts_name(block)
    module = block[name]
    block[name] = _IndexCapture()  # a plain dict entry: not a child module, so found by key
    try:
        block(x)
    except _Routed as routed:
        return routed.indices
    finally:
        block[name] = module
    raise UnsupportedModelError(f"{type(block).__name__}: its call never reached its "
                                f"expert module `{name}`")


def routed_experts(model, where) -> Tuple[List[str], int]:
    """(module paths of the routed-expert modules, in layer order; experts per token, as
    the first MoE block's own code routes) of an mlx-lm model or skeleton."""
    import mlx.core as mx

    paths = sorted((p for p, m in model.named_modules() if is_routed_experts(m)), key=layer_index)
    if not paths:
        raise UnsupportedModelError(
            f"{where}: {type(model).__module__.split('.')[-1]!r} has no routed experts "
            f"that mlx-lm computes with its switch layers (SwitchGLU / SwitchMLP): "
            f"nothing to stream")
    block = dict(model.named_modules())[moe_block_paths(model)[paths[0]]]
    indices = routed_indices(block, mx.zeros((1, 1, _hidden_size(model))))
    return paths, int(indices.shape[-1])


def _hidden_size(model) -> int:
    """The width of the decoder's hidden states: its token embedding's."""
    import mlx.nn as nn

    embedding = next(m for _, m in model.named_modules()
                     if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding)))
    if isinstance(embedding, nn.QuantizedEmbedding):
        return int(embedding.scales.shape[-1] * embedding.group_size)
    return int(embedding.weight.shape[-1])


def layer_index(module_path: str) -> int:
    """The decoder layer of a module path: `model.layers.3.mlp.switch_mlp` -> 3 (the first
    number in the path, whatever the family calls its list of layers)."""
    return int(next(part for part in module_path.split(".") if part.isdigit()))


def text_config(config: dict) -> dict:
    """The language model's config: vision-language wrappers nest it as `text_config`."""
    return {**config, **config.get("text_config", {})}


def kv_bytes_per_token(config: dict) -> int:
    """Bytes mlx-lm's KV cache takes per token (keys and values of every layer, in 16-bit
    floats): what a budget must leave room for. An upper bound for hybrid families, whose
    linear-attention layers keep a fixed-size state instead. Read the way the family's own
    ModelArgs reads its config (its defaults, its key names)."""
    args = {**text_config(config)}
    try:
        args = {**vars(_model_classes(config)[1].from_dict(config)), **args}
    except (ValueError, TypeError):
        pass
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
