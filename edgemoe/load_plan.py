"""The load plan: what both backends' `load()` settle before building a model, in one
order, from the same StreamOptions (edgemoe.mlx_backend.loader for MLX, edgemoe.cuda.model for
PyTorch build theirs over it):

    1. the model folder   a path or a hub id (default: the bundled model)
    2. the heads          the prerouter heads the routing mode runs with
    3. the adapter        the LoRA adapter folder the options name
    4. the source         the pack or checkpoint opened, its resident weights verified;
                          its config.json
       (the backend's checks: whatever must fail before anything is written or started)
    5. the deltas         the adapter's routed-expert deltas, as records beside the experts'
    6. the share          the experts this host holds (a group of hosts), the deltas beside
    7. the budget         `expert_budget`, "auto" made bytes
    8. the store          the expert store over the backend's slot memory

Neither MLX nor PyTorch here: a backend adds only what its framework knows (a `Backend`:
its checks, its share of a group, its memory and its slot memory; then it builds the model
over the plan and installs its routing).
"""

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from .format.deltas import DeltaRecords, expert_deltas, with_deltas
from .format.pack import Pack, PackError, read_json
from .format.source import NO_ADAPTER, model_path, open_source, pack_asset, resolve_asset
from .hub import resolve as resolve_hub_id
from .options import StreamOptions
from .routing.heads_config import heads_adapter
from .routing.modes import RoutingMode
from .streaming.budget import Budget, fitting_budget, fmt_bytes, is_auto
from .streaming.memory import MemoryFactory
from .streaming.store import ExpertStore


@dataclass
class LoadPlan:
    """A model to build: its folder and config, what streams and how, resolved once."""

    path: Path  # the model folder
    config: dict  # its config.json
    options: StreamOptions
    opened: Pack  # the source as opened: the whole model's experts
    heads: Optional[Path] = None  # the prerouter heads (None: the mode needs none)
    adapter: Optional[Path] = None  # the adapter folder
    deltas: Optional[DeltaRecords] = None  # the adapter's routed-expert deltas, streamed
    source: Optional[Pack] = None  # what this host streams: its share, deltas beside
    share: Any = None  # this host's share of a group (edgemoe.distributed.HostShare)
    budget: Optional[Budget] = None  # the experts' memory: "auto" made bytes
    store: Optional[ExpertStore] = None

    @property
    def routing(self) -> RoutingMode:
        return self.options.routing

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    @contextlib.contextmanager
    def building(self):
        """Build the model inside: a failed build closes the store (its reader threads)."""
        try:
            yield self
        except BaseException:
            self.store.close()
            raise


class Backend:
    """What a backend adds to the plan. The defaults ask nothing of a framework: no checks,
    one host, an auto budget of the memory available beside the resident weights as the
    files hold them."""

    where = ""  # whose memory an auto budget fills, as stderr names it ("cuda ")

    def check_family(self, config: dict, config_path: Path) -> None:
        """The model's family, from its config alone: a model this backend cannot run is
        refused before its weights are opened."""

    def check(self, plan: LoadPlan) -> None:
        """Once the heads and the adapter are found: fail before anything is written."""

    def share(self, plan: LoadPlan):
        """(the source this host streams, its share of a group or None)."""
        return plan.opened, None

    def memory_bytes(self) -> Optional[int]:
        """What an auto budget fills (None: the memory available)."""
        return None

    def resident_bytes(self, plan: LoadPlan) -> Optional[int]:
        """The resident weights as this backend holds them (None: as the files hold them)."""
        return None

    def slot_memory(self, plan: LoadPlan) -> MemoryFactory:
        """The slots' memory on this backend's device (the store's `memory`)."""
        raise NotImplementedError

    def build(self, plan: LoadPlan):
        """The model over the plan: the family's own class, its routed experts streaming
        from the plan's store."""
        raise NotImplementedError

    def install_routing(self, model, plan: LoadPlan) -> None:
        """The plan's routing mode on `model`, as every backend asks a mode: `advisory`
        (the next layer's router prefetches) or `routes` (the heads route); native is
        neither and installs nothing."""
        raise NotImplementedError


def plan_load(path_or_hf_repo: Optional[str], options: StreamOptions,
              backend: Backend) -> LoadPlan:
    """The plan of a load, resolved in the module's order; its store is open."""
    path = model_path(resolve_hub_id(path_or_hf_repo))  # a hub id: its folder in the cache
    heads = heads_folder(path, options.routing, options.prerouter_path)  # before any weight
    given = options.adapter_path
    adapter = None if given == NO_ADAPTER else \
        resolve_asset(given, path, "adapter", "--adapter-path")
    if given is None and heads is not None:  # the one the heads' routing was measured with
        adapter = heads_adapter(heads)
    config_path = path / "config.json"
    if config_path.is_file():  # (a folder without one: open_source says what it is not)
        backend.check_family(read_json(config_path), config_path)
    source = open_source(path, options.verify)
    if options.verify and source.resident_crc32 is None:  # in place, never indexed
        print(f"[edgemoe] {path}: an mlx-lm checkpoint read in place carries no checksums; "
              f"its weights are not verified (`python -m edgemoe.verify --model {path}` "
              f"indexes them once)", file=sys.stderr)
    elif options.verify:
        source.verify_resident(uncached=options.io == "direct")
    config = json.loads((path / "config.json").read_text())
    plan = LoadPlan(path, config, options, source, heads, adapter)
    backend.check(plan)  # before the deltas are written, or a thread started
    if adapter is not None:
        plan.deltas = expert_deltas(adapter, source)
    plan.source, plan.share = backend.share(plan)
    if plan.share is None and source.shard is not None and source.shard["hosts"] > 1:
        raise PackError(f"{path}: holds host {source.shard['index']}'s share of "
                        f"{source.shard['hosts']}; run it with its group (--distributed, "
                        f"launched by mlx.launch)")
    if plan.deltas is not None:
        plan.source = with_deltas(plan.source, plan.deltas)
    plan.budget = options.expert_budget
    if is_auto(plan.budget):  # what fits in the memory available, before loading
        plan.budget = fitting_budget(plan.source, config, backend.memory_bytes(),
                                     resident_bytes=backend.resident_bytes(plan))
        if plan.budget < plan.source.expert_bytes:
            print(f"[edgemoe] --expert-budget auto: {fmt_bytes(plan.budget)} "
                  f"({plan.budget / plan.source.expert_bytes:.0%} of the routed experts) "
                  f"fits in the {backend.where}memory available", file=sys.stderr)
    plan.store = ExpertStore(plan.source, plan.budget, options.cache_policy, options.io,
                             options.readers, memory=backend.slot_memory(plan),
                             folder=path,
                             read_timeout_s=options.read_timeout)
    return plan


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
