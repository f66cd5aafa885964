"""What both backends' `load()` settle before building a model (edgemoe.model.loader for
MLX, edgemoe.cuda.model for PyTorch), from the same StreamOptions:

    model_folder    the pack or checkpoint a path or hub id names
    heads_folder    the prerouter heads a routing mode runs with
    adapter_folder  the LoRA adapter the options name
    auto_budget     what `expert_budget="auto"` buys in the memory available
    open_store      the expert store over the backend's slot memory

Neither MLX nor PyTorch here: a backend adds only what its framework needs (its slot
memory, its resident weights' size, its model).
"""

import sys
from pathlib import Path
from typing import Optional

from .format.pack import Pack
from .format.source import model_path, pack_asset, resolve_asset
from .hub import resolve as resolve_hub_id
from .options import StreamOptions
from .routing.modes import RoutingMode
from .streaming.budget import Budget, fitting_budget, fmt_bytes
from .streaming.slots import MemoryFactory
from .streaming.store import ExpertStore


def model_folder(path_or_hf_repo: Optional[str]) -> Path:
    """The model folder of a path or a hub id (default: the bundled model)."""
    return model_path(resolve_hub_id(path_or_hf_repo))


def heads_folder(model: Path, routing: RoutingMode, given) -> Optional[Path]:
    """The prerouter heads `routing` runs with (None: a mode that needs none): `given` (a
    folder, or "pack" for the ones the model folder carries), else the model folder's."""
    routing.check_heads(given)
    if not routing.needs_heads:
        return None
    heads = resolve_asset(given, model, "prerouter", "--prerouter")
    if heads is not None:
        return heads
    heads = pack_asset(model, "prerouter")
    if heads is None:
        raise ValueError(f"--routing {routing} needs prerouter heads: pass --prerouter "
                         f"DIR (prerouter_path= in Python); {model} carries none "
                         f"(python -m edgemoe.train_prerouter makes them)")
    print(f"[edgemoe] --routing {routing}: the heads {model} carries ({heads})",
          file=sys.stderr)
    return heads


def adapter_folder(model: Path, options: StreamOptions) -> Optional[Path]:
    """The adapter folder the options name ("pack": the one the model folder carries)."""
    return resolve_asset(options.adapter_path, model, "adapter", "--adapter-path")


def auto_budget(source: Pack, config: dict, memory_bytes: Optional[int] = None,
                resident_bytes: Optional[int] = None, where: str = "") -> int:
    """`expert_budget="auto"`: the experts' bytes that fit in `memory_bytes` (default: what
    is available) beside the resident weights (edgemoe.streaming.budget.fitting_budget);
    stderr says so when that is not all of them (`where`: whose memory, "cuda ")."""
    budget = fitting_budget(source, config, memory_bytes, resident_bytes=resident_bytes)
    if budget < source.expert_bytes:
        print(f"[edgemoe] --expert-budget auto: {fmt_bytes(budget)} "
              f"({budget / source.expert_bytes:.0%} of the routed experts) fits in the "
              f"{where}memory available", file=sys.stderr)
    return budget


def open_store(source: Pack, model: Path, expert_budget: Budget, options: StreamOptions,
               memory: MemoryFactory) -> ExpertStore:
    """The store of `source`'s routed experts as the options stream them, its slots in the
    backend's `memory`; the model folder's learned cache policy serves "learned"."""
    return ExpertStore(source, expert_budget, options.cache_policy, options.io,
                       options.readers, memory=memory,
                       learned_policy=pack_asset(model, "cache_policy"),
                       read_timeout_s=options.read_timeout)
