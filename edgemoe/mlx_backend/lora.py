"""Recovery LoRA: a low-rank delta served beside the frozen int4 matmuls, never merged.

    y = quantized_matmul(x, W) + scale * ((x @ A) @ B)

mlx-lm's `LoRALinear` over a `QuantizedLinear` computes exactly this, so edgemoe reuses
it and mlx-lm's adapter format (`adapters.safetensors` + `adapter_config.json`): an
adapter loads with `edgemoe.load(..., adapter_path=DIR)` or `--adapter-path DIR`, as in
mlx-lm. What edgemoe adds is the choice of targets: every resident linear layer of the
decoder layers (attention projections, shared experts, dense MLPs) but never a router
gate, whose LoRA would change the routing (mlx-lm's default targets include it).

Merging the delta into the int4 weights and re-quantizing (mlx-lm's `fuse`) loses most of
it: the delta is small beside a quantization step. `merge_survival` measures how much.
"""

import json
import math
from pathlib import Path
from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear
from mlx_lm.tuner.utils import linear_to_lora_layers, load_adapters
from safetensors import safe_open

from ..format.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, lora_config
from ..format.families import is_router_path


def default_targets(model: nn.Module) -> List[str]:
    """Paths, relative to a decoder layer, of the resident linear layers to adapt."""
    keys = set()
    for layer in model.layers:
        for path, module in layer.named_modules():
            # a router is `gate` or `router` (and what a prerouted mode's RouterTap wraps)
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)) and not is_router_path(path):
                keys.add(path)
    return sorted(keys)


def expert_targets(model: nn.Module) -> List[str]:
    """Paths, relative to a decoder layer, of the routed experts' projections
    (`mlp.switch_mlp.gate_proj`, ...): a LoRA there gives every expert its own delta."""
    return sorted({path for layer in model.layers for path, module in layer.named_modules()
                   if isinstance(module, ExpertProjection)})


class ExpertProjection(nn.Module):
    """Where a LoRA of one routed-expert projection attaches; holds nothing."""

    def __init__(self, num_experts: int, input_dims: int, output_dims: int):
        super().__init__()
        self.num_experts, self.input_dims, self.output_dims = num_experts, input_dims, output_dims

    def to_lora(self, r: int, scale: float, dropout: float = 0.0) -> "ExpertDeltas":
        """mlx-lm's hook (linear_to_lora_layers): every expert's zero delta."""
        if dropout:
            raise ValueError(f"a LoRA of the routed experts takes no dropout ({dropout})")
        return ExpertDeltas(self.num_experts, self.input_dims, self.output_dims, r, scale)


class ExpertDeltas(nn.Module):
    """A LoRA of one routed-expert projection, every expert's: as mlx-lm's
    LoRASwitchLinear holds it (lora_a: experts x rank x in, lora_b: experts x out x rank)
    and computes it, over the slots."""

    made = 0  # how many were made, in this process (StreamingExperts.bind_deltas)

    def __init__(self, num_experts: int, input_dims: int, output_dims: int, rank: int,
                 scale: float):
        super().__init__()
        ExpertDeltas.made += 1
        bound = 1 / math.sqrt(input_dims)
        self.lora_a = mx.random.uniform(-bound, bound, (num_experts, rank, input_dims))
        self.lora_b = mx.zeros((num_experts, output_dims, rank))
        self.scale = scale

    @property
    def rank(self) -> int:
        return self.lora_a.shape[1]


def load_adapter(model: nn.Module, path: Path, streamed_experts: bool = False) -> nn.Module:
    """mlx-lm's `load_adapters`; with the routed experts' deltas streamed from their
    records (edgemoe.format.deltas), the rest of the adapter only: the deltas of every
    expert are never loaded."""
    if not streamed_experts:
        return load_adapters(model, str(path))
    path = Path(path)
    config = lora_config(path, " adapts the routed experts; edgemoe streams only a 'lora' "
                               "there")
    experts = set(expert_targets(model))
    params = dict(config["lora_parameters"])
    keys = params.get("keys") or _mlx_lm_default_keys(model)
    linear_to_lora_layers(model, config["num_layers"],
                          {**params, "keys": [k for k in keys if k not in experts]})
    allowed = {k: v.shape for k, v in tree_flatten(model.parameters())
               if k.rsplit(".", 1)[-1] in ("lora_a", "lora_b")}
    weights = []
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="mlx") as f:
        for name in f.keys():
            if _is_expert_key(name, experts):
                continue
            if name not in allowed:
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: {name}: not an adapter "
                                 f"parameter of the model")
            w = f.get_tensor(name)
            if w.shape != allowed[name]:
                raise ValueError(f"{path / ADAPTER_WEIGHTS}: {name}: shape {w.shape}, the "
                                 f"model's {allowed[name]}")
            weights.append((name, w))
    model.load_weights(weights, strict=False)
    return model


def _is_expert_key(name: str, experts) -> bool:
    """Whether an adapter tensor (`model.layers.3.mlp.switch_mlp.gate_proj.lora_a`) is a
    routed expert's delta (`experts`: paths within a decoder layer)."""
    parts = name.split(".")
    return len(parts) > 4 and ".".join(parts[3:-1]) in experts


def _mlx_lm_default_keys(model: nn.Module) -> List[str]:
    """The modules mlx-lm adapts when an adapter names none (its linear_to_lora_layers)."""
    keys = set()
    for layer in model.layers:
        for p, m in layer.named_modules():
            if hasattr(m, "to_lora") or isinstance(m, (nn.Linear, nn.QuantizedLinear,
                                                       nn.Embedding, nn.QuantizedEmbedding)):
                keys.add(p)
    return sorted(keys)


def apply_lora(model: nn.Module, rank: int = 8, scale: float = 20.0,
               targets: Optional[List[str]] = None) -> dict:
    """Freeze the model and add zero-initialised LoRA deltas (B = 0: the output is
    unchanged until trained); return the adapter's config in mlx-lm's format."""
    config = {"fine_tune_type": "lora", "num_layers": len(model.layers),
              "lora_parameters": {"rank": rank, "scale": scale, "dropout": 0.0,
                                  "keys": targets or default_targets(model)}}
    model.freeze()
    linear_to_lora_layers(model, config["num_layers"], config["lora_parameters"])
    return config


def save_adapter(model: nn.Module, config: dict, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.trainable_parameters()))
    mx.save_safetensors(str(path / ADAPTER_WEIGHTS), weights)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1))
    return path


def lora_layers(model: nn.Module) -> Dict[str, LoRALinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoRALinear)}


def merge_adapter(model: nn.Module) -> None:
    """Fold every delta into its weights and re-quantize them as they were (int4)."""
    model.update_modules(tree_unflatten([(n, m.fuse()) for n, m in lora_layers(model).items()]))


def survival(merged_effect: mx.array, effect: mx.array) -> float:
    """The part of `effect` that `merged_effect` still carries: its projection onto it
    (1: all of it, 0: none)."""
    effect = effect.astype(mx.float32)
    return (mx.sum(merged_effect.astype(mx.float32) * effect) / mx.sum(effect * effect)).item()


def _layer_inputs(model: nn.Module, inputs: mx.array) -> Dict[str, mx.array]:
    """What each adapted projection receives while `model` runs on `inputs`."""
    layers, seen = lora_layers(model), {}

    class Tap(nn.Module):
        def __init__(self, name, inner):
            super().__init__()
            self.inner, self.tap = inner, name

        def __call__(self, x):
            seen[self.tap] = x
            return self.inner(x)

    model.update_modules(tree_unflatten([(n, Tap(n, m)) for n, m in layers.items()]))
    try:
        model(inputs)
    finally:
        model.update_modules(tree_unflatten(list(layers.items())))
    return seen


def merge_survival(adapted: nn.Module, base: nn.Module, merged: nn.Module,
                   inputs: mx.array) -> dict:
    """How much of an adapter's effect survives merging and re-quantizing.

    `adapted` serves the adapter unmerged, `base` has none, `merged` has it merged
    (`merge_adapter`); all three share the same int4 weights. At each adapted projection,
    on the inputs it sees in `adapted`: (merged output - base output) projected on the
    unmerged delta. At the output: the same for next-token log-probs.
    """
    per_projection, layers = {}, lora_layers(adapted)
    for name, x in _layer_inputs(adapted, inputs).items():
        layer = layers[name]
        base_out = layer.linear(x)
        per_projection[name] = survival(layer.fuse()(x) - base_out, layer(x) - base_out)
    names = sorted(per_projection, key=lambda n: int(n.split(".")[2]))
    middle = [n for n in names if n.startswith(f"model.layers.{len(adapted.layers) // 2}.")]
    headline = next((n for n in middle if n.endswith("o_proj")), (middle or names)[0])
    log_probs = []
    for model in (adapted, base, merged):
        logits = model(inputs).astype(mx.float32)
        log_probs.append(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    lp_adapted, lp_base, lp_merged = log_probs
    return {"projection": headline, "projection_survival": per_projection[headline],
            "projection_survival_median": float(np.median(list(per_projection.values()))),
            "per_projection": per_projection,
            "logit_survival": survival(lp_merged - lp_base, lp_adapted - lp_base),
            "tokens": int(inputs.size)}
