"""A recovery LoRA served unmerged by the CUDA backend, as the MLX path serves it:

    y = base(x) + scale * ((x @ A) @ B)

The adapter is mlx-lm's format (adapters.safetensors + adapter_config.json, what
edgemoe.train_lora writes); its tensors are named by mlx-lm module paths,
`<module>.lora_a` of shape (input, rank) and `<module>.lora_b` of shape (rank, output),
and `lora_parameters.scale` is the scale. The math is mlx-lm's `LoRALinear` at
inference (dropout is off): the low-rank product in the adapter's dtype, added in the
activations' dtype. The base weights stay frozen and unmerged: merging into the int4
weights and re-quantizing would lose most of the delta (edgemoe.model.lora).

The modules adapted are those the weights file names (a module mlx-lm wraps but the file
omits has B = 0: no delta). Each must be a resident linear layer of the transformers
model, never a router: a LoRA there would change the routing. The routed experts' deltas
(mlx-lm's LoRASwitchLinear) are not read here: they stream with their experts, into the
same slots (edgemoe.format.deltas; edgemoe.cuda.experts adds them).
"""

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Sequence, Tuple

import torch
from safetensors import safe_open

from ..format.families import ROUTER_NAMES
from ..format.pack import PackError

ADAPTER_WEIGHTS = "adapters.safetensors"  # mlx-lm's names (edgemoe.model.lora's too)
ADAPTER_CONFIG = "adapter_config.json"
LEAVES = ("lora_a", "lora_b")


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
    weights_file, config_file = path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such adapter folder (expected {ADAPTER_WEIGHTS} "
                                f"and {ADAPTER_CONFIG}, mlx-lm's format)")
    for f in (config_file, weights_file):
        if not f.exists():
            raise FileNotFoundError(f"{f}: missing; an adapter folder holds {ADAPTER_WEIGHTS} "
                                    f"and {ADAPTER_CONFIG} (mlx-lm's format)")
    config = json.loads(config_file.read_text())
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise PackError(f"{config_file}: fine_tune_type {kind!r}; the CUDA backend serves "
                        f"'lora' adapters")
    scale = config.get("lora_parameters", {}).get("scale")
    if scale is None:
        raise PackError(f"{config_file}: no lora_parameters.scale (mlx-lm's LoRA config "
                        f"names it scale, not alpha)")
    pairs: Dict[str, Dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for name in f.keys():
            module, _, leaf = name.rpartition(".")
            if leaf not in LEAVES:
                raise PackError(f"{weights_file}: {name} is not a LoRA tensor (expected "
                                f"<module>.lora_a or .lora_b)")
            if not any(module.startswith(e + ".") for e in streamed):
                pairs.setdefault(module, {})[leaf] = f.get_tensor(name)
    weights = {}
    for module, pair in sorted(pairs.items()):
        missing = [leaf for leaf in LEAVES if leaf not in pair]
        if missing:
            raise PackError(f"{weights_file}: {module}.{missing[0]} missing (found only "
                            f"{module}.{next(iter(pair))})")
        weights[module] = (pair["lora_a"], pair["lora_b"])
    return Adapter(path, float(scale), weights)


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
        if set(ROUTER_NAMES) & set(name.split(".")):
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
