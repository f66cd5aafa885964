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
import os
import shutil
from pathlib import Path
from typing import Iterable, Optional, Sequence, Tuple

from .pack import PackError
from .resident import read_safetensors_header

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


def expert_key(name: str) -> bool:
    """Whether an adapter key or tensor name is a routed expert's (`mlp.switch_mlp.*`)."""
    return ".switch_mlp." in f".{name}"


def adapter_subset(adapter, out, layers: Iterable[int], attention_only: bool = False) -> Path:
    """A copy of the adapter folder `adapter` in `out` that adapts only the decoder layers
    `layers` (`model.layers.<i>.*`; the others' tensors left out: their deltas stay zero,
    and their experts stream no delta records). With `attention_only`, the routed
    experts' deltas are left out too (and their keys from the config): no delta records,
    no bytes added to a read. The tensors' bytes are copied as they are (no MLX here)."""
    weights, config_file = adapter_files(adapter)
    out, keep = Path(out), {int(l) for l in layers}
    header, start = read_safetensors_header(weights)
    kept = sorted(n for n in header if _layer(n) in keep
                  and not (attention_only and expert_key(n)))
    if not kept:
        raise ValueError(f"{weights}: no tensor of layers {sorted(keep)}"
                         f"{' outside the routed experts' if attention_only else ''}")
    entries, offset = {}, 0
    for name in kept:
        begin, end = header[name]["data_offsets"]
        entries[name] = {**header[name], "data_offsets": [offset, offset + end - begin]}
        offset += end - begin
    meta = json.dumps(entries, separators=(",", ":")).encode()
    meta += b" " * (-len(meta) % 8)
    config = json.loads(config_file.read_text())
    if attention_only:  # the modules its tensors adapt (model.layers.3.<key>.lora_a)
        config["lora_parameters"]["keys"] = sorted({".".join(n.split(".")[3:-1]) for n in kept})
    tmp = out.with_name(out.name + f".partial-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with open(weights, "rb") as src, open(tmp / ADAPTER_WEIGHTS, "wb") as dst:
        dst.write(len(meta).to_bytes(8, "little") + meta)
        for name in kept:
            begin, end = header[name]["data_offsets"]
            src.seek(start + begin)
            dst.write(src.read(end - begin))
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _layer(name: str) -> Optional[int]:
    """The decoder layer of a tensor `model.layers.<i>.*` (None: another tensor)."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 3 and parts[2].isdigit() else None
