"""The expert store: per-layer slot pools under a memory budget, filled in the background.

Each MoE layer owns a fixed pool of slots: one MLX array per expert tensor, shaped
(slots, ...). A slot is free, filling (the reader is writing it), ready, or in use
(a computation reads it). Compute asks `ensure(experts)` for a slot table; missing
experts are read on demand and waited for. A predictor may `prefetch` a layer's
experts ahead of time (advisory: the router still decides). The cache policy picks
which ready slot to give up; filling and in-use slots are never evicted.

This is the slot interface a backend implements (see SlotPool). The state machine and
the cache policy are shared by every backend; where a slot's bytes live is a layer's
SlotMemory: the MLX backend's slots are MLX arrays in unified memory, filled in place
through numpy views (edgemoe.experts); the CUDA backend's are device tensors filled from
pinned host rows by asynchronous copies (edgemoe.cuda.slots). This module needs neither
MLX nor PyTorch.
"""

import re
import threading
import time
from dataclasses import dataclass, fields
from typing import Callable, Dict, List, Optional, Protocol, Union

import numpy as np

from .cache import DEFAULT_POLICY, make_policy
from .pack import Pack, PackLayer
from .reader import Fill, Reader
from .trace import TraceRecorder

FREE, FILLING, READY, IN_USE = range(4)
WAIT_POLL_S = 0.1  # how often a waiting compute checks that the reader is alive


class BudgetError(ValueError):
    pass


class SlotPool(Protocol):
    """The seam between policy and hardware, one per MoE layer.

    `ensure` returns the expert -> slot table (-1 where absent) with every requested
    expert ready and marked in use; `release` ends that use once the computation
    that read the slots has finished; `prefetch` starts fills without waiting, for
    this layer's next call (`lead=0`) or the one after (`lead=1`).
    """

    num_slots: int

    def ensure(self, experts: np.ndarray, new_call: bool = True) -> np.ndarray: ...

    def release(self) -> None: ...

    def prefetch(self, experts: np.ndarray, lead: int = 0) -> None: ...


class SlotMemory(Protocol):
    """The bytes of one layer's slots, and the ordering a device needs around them.

    `arrays` are what compute reads: tensor name -> (num_slots, *shape). The reader
    writes a record into `rows(slot)` (host buffers, in the layer's tensor order) after
    calling `before_read(slot)`, then calls `after_read(slot)`; a slot turns ready only
    after that. Compute calls `acquire(slots)` before reading slots and `release(slots)`
    once its reads are issued; a slot is refilled only after its release.
    """

    arrays: Dict[str, object]

    def rows(self, slot: int) -> List[np.ndarray]: ...

    def before_read(self, slot: int) -> None: ...

    def after_read(self, slot: int) -> None: ...

    def acquire(self, slots: np.ndarray) -> None: ...

    def release(self, slots: np.ndarray) -> None: ...


# makes a layer's slot memory: (layer, number of slots) -> SlotMemory
MemoryFactory = Callable[[PackLayer, int], SlotMemory]


@dataclass
class ExpertStats:
    """Counters of one store; subtract two snapshots for the stats of a span."""

    hits: int = 0  # a needed expert was ready
    loads: int = 0  # fills started (on demand or prefetched)
    bytes_read: int = 0
    blocked_s: float = 0.0  # compute waited this long for fills
    evictions: int = 0
    late_fills: int = 0  # a needed expert was still filling (a prefetch that came late)
    prefetches: int = 0  # fills started by a predictor
    predicted: int = 0  # experts predicted for layers that then ran
    predicted_used: int = 0  # ... of which the router chose
    needed: int = 0  # experts needed at layers that had a prediction
    read_busy_s: float = 0.0  # wall time with a read in flight
    on_demand: int = 0  # fills started only when compute asked (nothing predicted them)

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.late_fills + self.loads - self.prefetches
        return self.hits / total if total > 0 else 1.0

    @property
    def precision(self) -> float:
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_used / self.needed if self.needed else 0.0

    @property
    def read_gbps(self) -> float:
        """Bandwidth while reading: bytes over the time a read was in flight."""
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    def __sub__(self, other: "ExpertStats") -> "ExpertStats":
        return ExpertStats(*(getattr(self, f.name) - getattr(other, f.name)
                             for f in fields(self)))

    def copy(self) -> "ExpertStats":
        return ExpertStats(*(getattr(self, f.name) for f in fields(self)))


_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_budget(budget: Union[None, int, float, str], total_bytes: int) -> int:
    """Bytes for a budget given as a fraction (0.25, "25%"), a byte count or "2GB"."""
    if budget is None:
        return total_bytes
    if isinstance(budget, str):
        text = budget.strip().upper()
        if text.endswith("%"):
            return parse_budget(float(text[:-1]) / 100, total_bytes)
        m = re.fullmatch(r"([0-9.]+)\s*([A-Z]*)", text)
        if not m or m.group(2) not in _UNITS:
            raise BudgetError(f"expert budget {budget!r}: expected a fraction like 0.25, "
                              f"a percentage like 25%, or a size like 2GB")
        value, unit = float(m.group(1)), m.group(2)
        if not unit and value <= 1:
            return parse_budget(value, total_bytes)
        return int(value * _UNITS[unit])
    if budget <= 0:
        raise BudgetError(f"expert budget {budget!r} must be positive")
    if budget <= 1:  # a fraction; no budget is a single byte
        return int(budget * total_bytes)
    return int(budget)


class LayerSlots:
    """The slot pool of one MoE layer: its state machine over a backend's SlotMemory."""

    def __init__(self, store: "ExpertStore", layer: PackLayer, num_slots: int, policy: str,
                 memory: MemoryFactory):
        self.store, self.layer, self.num_slots = store, layer, num_slots
        self.stats, self.lock = store.stats, store.lock
        self.memory = memory(layer, num_slots)
        self.slot_of = np.full(layer.num_experts, -1, dtype=np.int64)
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)
        self.state = np.full(num_slots, FREE, dtype=np.int8)
        self.fills: Dict[int, Fill] = {}  # expert -> its fill in flight
        self.policy = make_policy(policy)
        self.pending_prediction: Optional[set] = None  # for this layer's next call
        self.next_prediction: Optional[set] = None  # for the call after
        self.on_demand = 0

    def ensure(self, experts: np.ndarray, new_call: bool = True) -> np.ndarray:
        """`new_call=False` for the later passes of one call (more experts than slots)."""
        wanted = experts.tolist()
        assert len(wanted) <= self.num_slots
        waits, missing = [], []
        with self.lock:
            if new_call:
                self._score_prediction(wanted)
            for e in wanted:
                slot = self.slot_of[e]
                if slot >= 0 and self.state[slot] in (READY, IN_USE):
                    self.stats.hits += 1
                elif slot >= 0:
                    self.stats.late_fills += 1
                    waits.append(self.fills[e])
                else:
                    missing.append(e)
                self.policy.touch(e)
            self.stats.on_demand += len(missing)
            self.on_demand += len(missing)
        while missing:
            new, in_flight = [], []
            with self.lock:
                while missing and self._has_room(pinned=wanted):
                    new.append(self._start_fill(missing.pop(), pinned=wanted))
                if missing:  # every other slot is filling: a prefetch must land first
                    in_flight = [f for e, f in self.fills.items() if e not in wanted]
            if new:
                self.store.reader.submit(new)
                waits += new
            if in_flight:
                self._wait(in_flight[:1], raise_errors=False)
        self._wait(waits)
        with self.lock:
            used = self.slot_of[experts]
            self.state[used] = IN_USE
        self.memory.acquire(used)
        return self.slot_of

    @property
    def arrays(self) -> Dict[str, object]:
        """The slot tensors compute reads: name -> (num_slots, *shape)."""
        return self.memory.arrays

    def release(self):
        with self.lock:
            used = np.flatnonzero(self.state == IN_USE)
            # under the lock: no fill can claim these slots before their release is known
            self.memory.release(used)
            self.state[used] = READY
            # experts predicted for the next call that found no room, or that this
            # call's own loads evicted: read them now, a call ahead still
            missing = [e for e in self.pending_prediction or () if self.slot_of[e] < 0]
        if missing:
            self._fill_ahead(np.array(sorted(missing)))

    def prefetch(self, experts: np.ndarray, lead: int = 0):
        """Start reading `experts` (a prediction) where slots can be had without waiting.

        `lead` is how many of this layer's calls pass before the predicted one: 0 for a
        prediction about the current token, 1 for one about the next token. What finds
        no room now is read as soon as this layer's current call releases its slots.
        """
        with self.lock:
            if lead == 0:
                self.pending_prediction = set(experts.tolist())
            else:
                self.next_prediction = set(experts.tolist())
        self._fill_ahead(experts)

    def _fill_ahead(self, experts: np.ndarray):
        new = []
        with self.lock:
            # the experts predicted for this layer's next call stay too
            pinned = set(experts.tolist()) | (self.pending_prediction or set())
            for e in experts.tolist():
                if self.slot_of[e] >= 0:
                    continue
                if not self._has_room(pinned=pinned):
                    break  # release() reads the rest once this layer's call is done
                new.append(self._start_fill(e, pinned=pinned))
            self.stats.prefetches += len(new)
        if new:
            self.store.reader.submit(new)

    def _score_prediction(self, wanted):
        if self.pending_prediction is not None:
            self.stats.predicted += len(self.pending_prediction)
            self.stats.predicted_used += len(self.pending_prediction.intersection(wanted))
            self.stats.needed += len(wanted)
        self.pending_prediction, self.next_prediction = self.next_prediction, None

    def _wait(self, fills, raise_errors=True):
        tic = time.perf_counter()
        for f in fills:
            while not f.done.wait(WAIT_POLL_S):
                if not self.store.reader.alive():
                    raise RuntimeError("edgemoe: the expert reader thread died")
        if fills:
            self.stats.blocked_s += time.perf_counter() - tic
        for f in fills:
            if f.error is not None and raise_errors:
                raise f.error

    def _evictable(self, pinned) -> list:
        busy = set(pinned) | set(self.fills)
        return [e for e in self.expert_in.tolist()
                if e >= 0 and e not in busy and self.state[self.slot_of[e]] == READY]

    def _has_room(self, pinned) -> bool:
        return bool((self.state == FREE).any()) or bool(self._evictable(pinned))

    def _start_fill(self, expert: int, pinned) -> Fill:
        """Claim a slot for `expert` (the caller holds the lock) and describe its fill."""
        free = np.flatnonzero(self.state == FREE)
        if len(free):
            slot = int(free[0])
        else:
            candidates = set(self._evictable(pinned))
            # pinned: the experts this step needs, whether resident yet or not
            victim = self.policy.victim([e for e in self.expert_in.tolist()
                                         if e not in candidates] + list(pinned))
            assert victim is not None and victim in candidates
            slot = int(self.slot_of[victim])
            self.slot_of[victim] = -1
            self.policy.forget(victim)
            self.stats.evictions += 1
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.state[slot] = FILLING
        fill = Fill(self.layer.index, expert, slot, self.layer.records[expert],
                    self.memory.rows(slot), self._filled, before_read=self.memory.before_read)
        self.fills[expert] = fill
        self.policy.touch(expert)
        self.stats.loads += 1
        return fill

    def _filled(self, fill: Fill, nbytes: int, error: Optional[Exception]):
        """Called by a reader thread when a fill ends, well or not."""
        if error is None:
            try:
                self.memory.after_read(fill.slot)  # e.g. start the copy to the device
            except Exception as e:
                error = e
        with self.lock:
            self.fills.pop(fill.expert, None)
            if error is None:
                self.state[fill.slot] = READY
                self.stats.bytes_read += nbytes
            else:
                self.slot_of[fill.expert] = -1
                self.expert_in[fill.slot] = -1
                self.state[fill.slot] = FREE
                self.policy.forget(fill.expert)
                fill.error = error
        fill.done.set()


class ExpertStore:
    """All MoE layers' slot pools for one pack, under one memory budget."""

    def __init__(self, pack: Pack, expert_budget=1.0, cache_policy: str = DEFAULT_POLICY,
                 io: str = "buffered", readers: int = 2, memory: Optional[MemoryFactory] = None):
        """`memory` makes each layer's SlotMemory; by default MLX arrays (edgemoe.experts)."""
        self.reader = None
        self.pack = pack
        self.budget_bytes = parse_budget(expert_budget, pack.expert_bytes)
        minimum = self.minimum_budget(pack)
        if self.budget_bytes < minimum:
            raise BudgetError(
                f"expert budget {_fmt_bytes(self.budget_bytes)} cannot hold one layer's "
                f"top-{pack.top_k} experts in every MoE layer; the minimum is "
                f"{_fmt_bytes(minimum)} ({minimum} bytes, "
                f"{minimum / pack.expert_bytes:.1%} of the routed experts)"
            )
        per_slot = sum(l.expert_bytes for l in pack.layers)  # one slot in every layer
        max_experts = min(l.num_experts for l in pack.layers)
        self.slots_per_layer = min(self.budget_bytes // per_slot, max_experts)
        self.stats = ExpertStats()
        self.lock = threading.Lock()
        self.trace: Optional[TraceRecorder] = None
        self.predictor = None  # set for advisory routing: prefetches the next layer
        if memory is None:
            from .experts import MLXSlotMemory as memory  # imports MLX only when used
        self.reader = Reader(pack, readers, io)
        self.layers: Dict[str, LayerSlots] = {
            l.module: LayerSlots(self, l, self.slots_per_layer, cache_policy, memory)
            for l in pack.layers
        }
        self.by_index = {s.layer.index: s for s in self.layers.values()}

    @staticmethod
    def minimum_budget(pack: Pack) -> int:
        """Bytes for top-k slots in every MoE layer: one token's experts."""
        return pack.top_k * sum(l.expert_bytes for l in pack.layers)

    @property
    def slot_bytes(self) -> int:
        """Memory the slot pools hold."""
        return self.slots_per_layer * sum(l.expert_bytes for l in self.pack.layers)

    def snapshot(self) -> ExpertStats:
        with self.lock:
            stats = self.stats.copy()
        stats.read_busy_s = self.reader.busy_s
        return stats

    def advise(self, layer_index: int, hidden, routed: np.ndarray):
        """Let the predictor see a layer's input and routing; prefetch what it predicts."""
        if self.predictor is None:
            return
        lead = 0 if getattr(self.predictor, "same_token", True) else 1
        for target, ids in self.predictor.predict(layer_index, hidden, routed).items():
            self.by_index[target].prefetch(np.unique(ids), lead)

    def reset(self):
        """Forget per-request state (a predictor's memory of the previous token)."""
        if hasattr(self.predictor, "reset"):
            self.predictor.reset()

    def start_trace(self) -> TraceRecorder:
        """Record the routing of every forward call from now on."""
        self.trace = TraceRecorder([l.index for l in self.pack.layers],
                                   [l.expert_bytes for l in self.pack.layers],
                                   [l.num_experts for l in self.pack.layers])
        return self.trace

    def close(self):
        if self.reader is not None:
            self.reader.close()
            self.reader = None

    def __del__(self):
        self.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
