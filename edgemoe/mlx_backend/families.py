"""A family's routed experts, found in mlx-lm's own model for its config.

A family is supported by capability, not by name: its MoE blocks call an mlx-lm switch
layer (`SwitchGLU` / `SwitchMLP`) with the indices their own routing chose, so swapping
that module for a streaming one (edgemoe.mlx_backend.experts) keeps the family's routing
math exact. The experts are found in mlx-lm's model, built from the config with its
weights left unmaterialised (`skeleton`): which modules are the routed experts, and how
many the first MoE block's own code routes each token to (`find_experts`, what
edgemoe.format.inplace asks of an mlx-lm checkpoint read in place, on either backend).
What needs no model (the refused families, router paths, layer numbers, the KV cache's
size) is edgemoe.format.families. mlx and mlx-lm are imported on first use: the CUDA
backend imports this module to read an mlx-lm checkpoint in place, and only then.
"""

import importlib
from pathlib import Path
from typing import Dict, List, Tuple

from ..format.families import (ROUTER_NAMES, UnsupportedModelError, check_supported,
                               layer_index)


def check_runs(config: dict, where) -> str:
    """The config's model_type, if edgemoe streams it (edgemoe.format.families'
    check_supported: not refused, its shape possible) and mlx-lm runs it."""
    model_type = check_supported(config, where)  # first: arithmetic, before mlx-lm's classes
    try:
        _model_classes(config)
    except ValueError:
        raise UnsupportedModelError(f"{where}: model_type {model_type!r} is not a model "
                                    f"mlx-lm {_mlx_lm_version()} runs") from None
    return model_type


def find_experts(config: dict, where) -> Tuple[List[str], int]:
    """(module paths of the routed-expert modules, in layer order; experts per token) of
    the model `config` describes, as mlx-lm builds it: a model_type mlx-lm does not run,
    or a model without routed experts, is refused (UnsupportedModelError)."""
    check_runs(config, where)
    return routed_experts(skeleton(config), where)


def model_args(config: dict) -> dict:
    """The config as the family's ModelArgs reads it (its defaults, its key names): what
    edgemoe.format.families.kv_bytes_per_token reads beside the config's own values."""
    try:
        return vars(_model_classes(config)[1].from_dict(config))
    except (ValueError, TypeError):
        return {}


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


def routed_experts(model, where: Path) -> Tuple[List[str], int]:
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
