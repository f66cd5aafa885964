"""The expert store: every MoE layer's slot pool under one memory budget, one reader.

It is the memory manager and nothing else: it is told which experts a call needs
(`pool(layer).ensure`, through edgemoe.streaming.calls) and which to read ahead
(`prefetch`), and it counts what that cost (`snapshot`). Routing decisions are made on
the model side (edgemoe.routing); a prediction reaches the store only as "prefetch these
experts for layer l with this lead".

    store = ExpertStore(open_source(path), expert_budget="25%", memory=MLXSlotMemory)
    store.info()       # sizes: slots per layer, budget, bytes held, io mode, files
    store.snapshot()   # ExpertStats; subtract two for a span
    store.start_trace()  # record routing and prefetches for edgemoe.cache_sim
    store.close()
"""

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from ..format.pack import Pack
from .budget import Budget, SlotPlan
from .cache import DEFAULT_POLICY, make_policy
from .memory import MemoryFactory
from .reader import Reader
from .slots import LayerSlots
from .stats import ExpertStats
from .telemetry import page_cache_bytes
from .trace import TraceRecorder


@dataclass(frozen=True)
class StoreInfo:
    """What a store holds, for tools and logs."""

    path: Path
    model_type: str
    moe_layers: int
    experts_per_layer: int  # of the smallest layer
    top_k: int
    slots_per_layer: int
    budget_bytes: int  # what was asked for
    slot_bytes: int  # what the slot pools hold
    expert_bytes: int  # every routed expert
    minimum_bytes: int
    io: str  # buffered, direct, or buffered+dontneed
    in_place: bool  # an mlx-lm checkpoint read as it is
    files: List[Path]  # the files experts are read from


class ExpertStore:
    """All MoE layers' slot pools for one pack, under one memory budget."""

    def __init__(self, pack: Pack, expert_budget: Budget = 1.0,
                 cache_policy: str = DEFAULT_POLICY, io: str = "buffered", readers: int = 2,
                 *, memory: MemoryFactory, reader=None,
                 folder: Optional[Path] = None, read_timeout_s: Optional[float] = 30.0):
        """`memory` makes each layer's SlotMemory (the backend's: edgemoe.mlx_backend.slots for
        MLX, edgemoe.cuda.slots; NoMemory for a replay); `reader` fills slots (default:
        `readers` threads of edgemoe.streaming.reader); `folder`: the model's, where
        a cache policy finds what was trained for it (edgemoe.streaming.cache). A compute
        that waits longer than `read_timeout_s` for a read fails with a PackError, and
        the store reports itself unhealthy while a read takes that long."""
        self.read_timeout_s = read_timeout_s
        self.reader = None
        self.pack = pack
        self.plan = SlotPlan.of(pack)
        self.budget_bytes = self.plan.budget_bytes(expert_budget)
        self.slots_per_layer = self.plan.slots(expert_budget)
        self.stats = ExpertStats()
        self.lock = threading.Lock()
        self.trace: Optional[TraceRecorder] = None
        self.gated = False  # see gate_prefetches
        # counts the model side keeps on the device until asked (edgemoe.mlx_backend.hostsync)
        self.settle: Optional[Callable[[], None]] = None
        if not callable(cache_policy):  # a bad name or file fails before threads start
            make_policy(cache_policy, folder)
        # a fresh policy as each layer's slots use (cache-conditional routing simulates them)
        self.new_policy = lambda: make_policy(cache_policy, folder)
        self.reader = reader if reader is not None else Reader(pack, readers, io)
        self.layers: Dict[str, LayerSlots] = {
            l.module: LayerSlots(l, self.slots_per_layer,
                                 make_policy(cache_policy, folder),
                                 memory(l, self.slots_per_layer), self.reader, self.stats,
                                 self.lock)
            for l in pack.layers
        }
        self._by_index = {s.layer.index: s for s in self.layers.values()}
        for slots in self.layers.values():
            slots.read_timeout_s = read_timeout_s

    def pool(self, layer_index: int) -> LayerSlots:
        """The slot pool of a decoder layer (by its index in the model)."""
        return self._by_index[layer_index]

    @property
    def layer_indices(self) -> List[int]:
        return sorted(self._by_index)

    def gate_prefetches(self, gated: bool = True):
        """Prefetch for a layer only while its predictions prove right (advisory routing:
        edgemoe.streaming.prefetch), or always (prerouted: the prediction is the routing)."""
        self.gated = gated
        for pool in self._by_index.values():
            pool.gated = gated

    def prefetch(self, layer_index: int, experts: np.ndarray, lead: int = 0):
        """Read `experts` of a layer ahead of its call `lead` calls from now (0: the next),
        gated as `gate_prefetches` said."""
        # distinct and sorted; a set, not np.unique: a few ids, on the decode path
        experts = np.array(sorted(set(experts.ravel().tolist())), dtype=np.int64)
        if self.trace is not None:
            self.trace.record_prefetch(layer_index, experts, lead)
        self._by_index[layer_index].prefetch(experts, lead)

    def snapshot(self) -> ExpertStats:
        if self.settle is not None:
            self.settle()
        with self.lock:
            stats = self.stats.copy()
        stats.read_busy_s = getattr(self.reader, "busy_s", 0.0)
        stats.verify_s = getattr(self.reader, "verify_s", 0.0)
        return stats

    def healthy(self) -> bool:
        """False while a read has been in flight longer than the read timeout."""
        if self.reader is None:
            return False
        oldest = getattr(self.reader, "oldest_read_s", lambda: 0.0)()
        return self.read_timeout_s is None or oldest <= self.read_timeout_s

    def on_demand_by_layer(self) -> Dict[int, int]:
        """Experts read only when a call asked for them, per decoder layer."""
        with self.lock:
            return {i: s.on_demand for i, s in self._by_index.items()}

    def info(self) -> StoreInfo:
        p = self.plan
        return StoreInfo(self.pack.path, self.pack.model_type, len(self.pack.layers),
                         min(p.num_experts), p.top_k, self.slots_per_layer,
                         self.budget_bytes, p.memory(self.slots_per_layer), p.total_bytes,
                         p.minimum_bytes, getattr(self.reader, "io", "none"),
                         self.pack.in_place, list(self.pack.files))

    def page_cache_bytes(self) -> int:
        """Bytes of the expert files in the OS page cache now."""
        return sum(page_cache_bytes(f) for f in self.pack.files)

    def start_trace(self) -> TraceRecorder:
        """Record the routing of every forward call, and every prefetch, from now on."""
        self.trace = TraceRecorder([l.index for l in self.pack.layers],
                                   [l.expert_bytes for l in self.pack.layers],
                                   [l.num_experts for l in self.pack.layers],
                                   model=self.pack.fingerprint)
        self.trace.prefetch_gated = self.gated  # for cache_sim's replay of the prefetches
        for slots in self.layers.values():
            slots.trace = self.trace
        return self.trace

    def close(self):
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __del__(self):
        self.close()
