"""LoRA adapters in mlx-lm's format, as every reader of them sees one: the MLX path
(edgemoe.mlx_backend.lora), the CUDA backend (edgemoe.cuda.lora) and the routed experts' delta
records (edgemoe.format.deltas).

    ADAPTER/adapters.safetensors   `<module>.lora_a` (input, rank), `<module>.lora_b`
                                   (rank, output), named by mlx-lm module paths
    ADAPTER/adapter_config.json    fine_tune_type, num_layers, lora_parameters (rank,
                                   scale, keys)

Neither MLX nor PyTorch here: only the files, the config and the tensors' names.
"""

import json
from pathlib import Path
from typing import Optional, Sequence, Tuple

from .pack import PackError

ADAPTER_WEIGHTS = "adapters.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
LEAVES = ("lora_a", "lora_b")  # a LoRA tensor's last name: A, then B


def adapter_files(path) -> Tuple[Path, Path]:
    """The weights and config files of an adapter folder, which must hold both."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such adapter folder (expected {ADAPTER_WEIGHTS} "
                                f"and {ADAPTER_CONFIG}, mlx-lm's format)")
    weights, config = path / ADAPTER_WEIGHTS, path / ADAPTER_CONFIG
    for f in (config, weights):
        if not f.exists():
            raise FileNotFoundError(f"{f}: missing; an adapter folder holds {ADAPTER_WEIGHTS} "
                                    f"and {ADAPTER_CONFIG} (mlx-lm's format)")
    return weights, config


def lora_config(path, refusal: str) -> dict:
    """An adapter folder's config, which must be a LoRA's (`refusal` ends the error for
    another fine_tune_type: what the reader serves instead)."""
    config_file = Path(path) / ADAPTER_CONFIG
    config = json.loads(config_file.read_text())
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora":
        raise PackError(f"{config_file}: fine_tune_type {kind!r}{refusal}")
    return config


def lora_scale(config: dict, config_file: Path) -> float:
    """The scale of a LoRA's deltas (mlx-lm's lora_parameters.scale)."""
    scale = config.get("lora_parameters", {}).get("scale")
    if scale is None:
        raise PackError(f"{config_file}: no lora_parameters.scale (mlx-lm's LoRA config "
                        f"names it scale, not alpha)")
    return float(scale)


def lora_key(name: str) -> Tuple[str, str]:
    """(module path, leaf) of a LoRA tensor's name: `model.layers.3.self_attn.q_proj.lora_a`
    is ("model.layers.3.self_attn.q_proj", "lora_a"); the leaf is "" for any other name."""
    module, _, leaf = name.rpartition(".")
    return (module, leaf) if leaf in LEAVES else (name, "")


def owner(name: str, modules: Sequence[str]) -> Optional[str]:
    """The module of `modules` (paths) that holds the tensor `name`, or None."""
    return next((m for m in modules if name.startswith(m + ".")), None)
