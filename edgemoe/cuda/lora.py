"""A recovery LoRA served unmerged by the CUDA backend, as the MLX path serves it:

    y = base(x) + scale * ((x @ A) @ B)

The adapter is mlx-lm's format (adapters.safetensors + adapter_config.json, what
edgemoe.train_lora writes); its tensors are named by mlx-lm module paths,
`<module>.lora_a` of shape (input, rank) and `<module>.lora_b` of shape (rank, output),
and `lora_parameters.scale` is the scale. The math is mlx-lm's `LoRALinear` at
inference (dropout is off): the low-rank product in the adapter's dtype, added in the
activations' dtype. The base weights stay frozen and unmerged: merging into the int4
weights and re-quantizing would lose most of the delta (edgemoe.mlx_backend.lora).

The modules adapted are those the weights file names (a module mlx-lm wraps but the file
omits has B = 0: no delta). Each must be a resident linear layer of the transformers
model, never a router: a LoRA there would change the routing. The routed experts' deltas
(mlx-lm's LoRASwitchLinear) are not read here: they stream with their experts, into the
same slots (edgemoe.format.deltas; edgemoe.cuda.experts adds them).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch
from safetensors import safe_open

from ..format.adapters import (ADAPTER_WEIGHTS, LEAVES, adapter_files, lora_config, lora_key,
                               lora_scale, owner)
from ..format.families import is_router_path
from ..format.pack import PackError


class LoRALinear(torch.nn.Module):
    """A frozen linear layer plus a low-rank delta, computed as mlx-lm's LoRALinear."""

    def __init__(self, linear: torch.nn.Linear, lora_a: torch.Tensor, lora_b: torch.Tensor,
                 scale: float):
        super().__init__()
        self.linear = linear.requires_grad_(False)
        device = linear.weight.device
        self.lora_a = torch.nn.Parameter(lora_a.to(device), requires_grad=False)
        self.lora_b = torch.nn.Parameter(lora_b.to(device), requires_grad=False)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = (x.to(self.lora_a.dtype) @ self.lora_a) @ self.lora_b
        return self.linear(x) + (self.scale * z).to(x.dtype)


@dataclass
class Adapter:
    path: Path
    scale: float
    weights: Dict[str, Tuple[torch.Tensor, torch.Tensor]]  # mlx-lm module path -> (A, B)


def read_adapter(path, streamed: Sequence[str] = ()) -> Adapter:
    """An adapter folder in mlx-lm's LoRA format, checked for what serving needs; the
    deltas of the `streamed` expert modules (mlx-lm paths) are left on disk."""
    path = Path(path)
    weights_file, config_file = adapter_files(path)
    config = lora_config(path, "; the CUDA backend serves 'lora' adapters")
    scale = lora_scale(config, config_file)
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for name in f.keys():
            module, leaf = lora_key(name)
            if not leaf:
                raise PackError(f"{weights_file}: {name} is not a LoRA tensor (expected "
                                f"<module>.lora_a or .lora_b)")
            if owner(name, streamed) is None:
                pairs.setdefault(module, {})[leaf] = f.get_tensor(name)
    return Adapter(path, scale, _paired(pairs, weights_file))


def _paired(pairs: Dict[str, Dict[str, torch.Tensor]], weights_file: Path) -> Dict[str, tuple]:
    """{module: (A, B)}: every module's two tensors, both present."""
    weights = {}
    for module, pair in sorted(pairs.items()):
        missing = [leaf for leaf in LEAVES if leaf not in pair]
        if missing:
            raise PackError(f"{weights_file}: {module}.{missing[0]} missing (found only "
                            f"{module}.{next(iter(pair))})")
        weights[module] = (pair["lora_a"], pair["lora_b"])
    return weights


def apply_adapter(model: torch.nn.Module, adapter: Adapter,
                  renames: Sequence[Tuple[str, str]] = ()) -> Dict[str, LoRALinear]:
    """Wrap each linear layer the adapter names (an mlx-lm path, renamed by `renames` to
    transformers' module names) in a LoRALinear; return them by transformers' names."""
    weights_file = adapter.path / ADAPTER_WEIGHTS
    wrapped = {}
    for module, (a, b) in adapter.weights.items():
        name = module
        for old, new in renames:
            name = f".{name}.".replace(old, new)[1:-1]
        if is_router_path(name):
            raise PackError(f"{weights_file}: {module} is a router; a LoRA there would change "
                            f"the routing, and edgemoe adapts resident linear layers only")
        try:
            linear = model.get_submodule(name)
        except AttributeError:
            raise PackError(f"{weights_file}: {module}.lora_a names no module of the "
                            f"{model.config.model_type} model (looked for {name})") from None
        if not isinstance(linear, torch.nn.Linear):
            raise PackError(f"{weights_file}: {module} is a {type(linear).__name__}, not a "
                            f"linear layer; the CUDA backend adapts linear layers only")
        expected = ((linear.in_features, a.shape[-1]), (a.shape[-1], linear.out_features))
        if a.dim() != 2 or (tuple(a.shape), tuple(b.shape)) != expected:
            raise PackError(f"{weights_file}: {module}: lora_a {tuple(a.shape)}, lora_b "
                            f"{tuple(b.shape)}; expected {expected[0]} and {expected[1]} for "
                            f"its {linear.in_features} -> {linear.out_features} linear layer")
        wrapped[name] = LoRALinear(linear, a, b, adapter.scale)
    for name, module in wrapped.items():
        model.set_submodule(name, module)
    return wrapped
