"""Recovery LoRA: a low-rank delta served beside the frozen int4 matmuls, never merged.

    y = quantized_matmul(x, W) + scale * ((x @ A) @ B)

mlx-lm's `LoRALinear` over a `QuantizedLinear` computes exactly this, so edgemoe reuses
it and mlx-lm's adapter format (`adapters.safetensors` + `adapter_config.json`): an
adapter loads with `edgemoe.load(..., adapter_path=DIR)` or `--adapter-path DIR`, as in
mlx-lm. What edgemoe adds is the choice of targets: every resident linear layer of the
decoder layers (attention projections, shared experts, dense MLPs) but never a router
gate, whose LoRA would change the routing (mlx-lm's default targets include it).
"""

import json
from pathlib import Path
from typing import List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.tuner.utils import linear_to_lora_layers

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def default_targets(model: nn.Module) -> List[str]:
    """Paths, relative to a decoder layer, of the resident linear layers to adapt."""
    keys = set()
    for layer in model.layers:
        for path, module in layer.named_modules():
            last = path.rsplit(".", 1)[-1]
            if isinstance(module, (nn.Linear, nn.QuantizedLinear)) and last != "gate":
                keys.add(path)
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
