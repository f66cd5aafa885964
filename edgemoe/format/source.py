"""The one opener of streamable models: an edgemoe pack, or an mlx-lm quantized checkpoint
read in place. Every tool opens a model folder through `open_source`, so that both kinds
work everywhere and fail with the same messages.

A pack may carry what was trained for it beside its weights, found by `pack_asset`:

    prerouter/        prerouter heads (edgemoe.train_prerouter)
    adapter/          a recovery LoRA (edgemoe.train_lora), in mlx-lm's adapter format
    cache_policy.npz  weights of the learned cache policy (edgemoe.cache_sim train-learned)
"""

import json
from pathlib import Path
from typing import Optional

from .families import check_supported
from .inplace import open_mlx_lm
from .pack import EXPERTS_FILE, MANIFEST, Pack, PackError, read_json

BUNDLED_MODEL = Path(__file__).resolve().parents[1] / "models" / "fine"
PACK_ASSETS = {"prerouter": "prerouter", "adapter": "adapter", "cache_policy": "cache_policy.npz"}
SHARD_INDEX = "model.safetensors.index.json"
NO_ADAPTER = "none"  # as --adapter-path: no adapter, not even the one the heads carry
OWN = "pack"  # as a path (--prerouter pack, --adapter-path pack): the model folder's own


def model_path(path=None) -> Path:
    """The model folder: `path`, or the bundled model when None. It must exist
    and hold a config.json."""
    path = Path(path) if path is not None else BUNDLED_MODEL
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: no such model folder")
    config = path / "config.json"
    if not config.exists():
        raise FileNotFoundError(f"{path}: no config.json: not an edgemoe pack nor an mlx-lm "
                                f"checkpoint; is this a model folder?")
    check_shards(path)
    return path


def check_shards(path: Path):
    """Every weight file a sharded checkpoint's index names must be there: a missing one
    is named, not found later as missing tensors."""
    index = path / SHARD_INDEX
    if not index.exists():
        return
    try:
        shards = set(read_json(index)["weight_map"].values())
    except (PackError, KeyError, TypeError, AttributeError):
        raise PackError(f"{index}: not a safetensors index (no weight_map)") from None
    missing = sorted(s for s in shards if not (path / s).exists())
    if missing:
        raise FileNotFoundError(f"{path / missing[0]}: missing (named by {SHARD_INDEX}"
                                + (f", with {len(missing) - 1} more)" if len(missing) > 1
                                   else ")"))


def source_kind(path) -> str:
    """'pack' (an edgemoe pack), 'mlx-lm' (a quantized mlx-lm checkpoint, streamable in
    place) or 'hf' (anything else: a Hugging Face checkpoint, to convert first)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return "pack"
    try:
        config = read_json(path / "config.json")
    except (OSError, PackError):
        return "hf"
    return "mlx-lm" if "quantization" in config else "hf"


def open_source(path=None, verify: bool = True) -> Pack:
    """The routed experts of a model folder: a pack's records, or an mlx-lm checkpoint's
    tensor slices read in place (checksummed if `edgemoe.verify` indexed them). `verify`:
    a pack must have every checksum (Pack.open), an index must match its checkpoint."""
    path = model_path(path)
    config = read_json(path / "config.json")
    check_supported(config, path / "config.json")
    if source_kind(path) == "pack" or (path / EXPERTS_FILE).exists():
        return Pack.open(path, verify)  # an experts.bin without its manifest is a broken pack
    return open_mlx_lm(path, verify)


def pack_asset(model: Path, name: str) -> Optional[Path]:
    """A trained asset the model folder carries (see the module doc), or None."""
    found = Path(model) / PACK_ASSETS[name]
    return found if found.exists() else None


def resolve_asset(given, model: Path, name: str, flag: str) -> Optional[Path]:
    """`given` as a path, with the short name 'pack' for the model folder's own asset."""
    if given is None:
        return None
    if str(given) != OWN:
        return Path(given)
    found = pack_asset(model, name)
    if found is None:
        raise PackError(f"{flag} {OWN}: {model} carries no {PACK_ASSETS[name]}")
    return found
