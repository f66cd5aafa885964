"""The expert store: per-layer slot pools under a memory budget, filled by pread.

Each MoE layer owns a fixed pool of slots: one MLX array per expert tensor, shaped
(slots, ...). Loading an expert is one `os.preadv` of its record, scattered straight
into the slot rows through numpy views of the MLX arrays' memory (no extra copy).
"""

import os
import re
import time
import zlib
from dataclasses import dataclass, fields
from typing import Dict, Optional, Union

import mlx.core as mx
import numpy as np

from .cache import DEFAULT_POLICY, make_policy
from .pack import Pack, PackError, PackLayer
from .trace import TraceRecorder


class BudgetError(ValueError):
    pass


@dataclass
class ExpertStats:
    """Counters of one store; subtract two snapshots for the stats of a span."""

    hits: int = 0
    loads: int = 0
    bytes_read: int = 0
    blocked_s: float = 0.0  # compute waited this long for expert loads
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.loads
        return self.hits / total if total else 1.0

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
    """A fixed pool of expert slots for one MoE layer, filled synchronously on demand."""

    def __init__(self, store: "ExpertStore", layer: PackLayer, num_slots: int, policy: str):
        self.store, self.layer, self.num_slots = store, layer, num_slots
        self.stats = store.stats
        self.arrays: Dict[str, mx.array] = {}
        self._rows: Dict[str, np.ndarray] = {}  # writable views of self.arrays
        for t in layer.tensors:
            self.arrays[t.name], self._rows[t.name] = _slot_array(num_slots, t.shape, t.dtype)
        self.slot_of = np.full(layer.num_experts, -1, dtype=np.int64)
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)
        self.policy = make_policy(policy)

    def ensure(self, experts: np.ndarray) -> np.ndarray:
        """Make `experts` resident; return the expert -> slot table.

        The caller must have finished every computation that reads this pool:
        a slot may be refilled here.
        """
        assert len(experts) <= self.num_slots
        missing = []
        for e in experts.tolist():
            if self.slot_of[e] >= 0:
                self.stats.hits += 1
            else:
                missing.append(e)
            self.policy.touch(e)
        if missing:
            tic = time.perf_counter()
            for e in missing:
                self._load(e, self._free_slot(pinned=experts))
            self.stats.blocked_s += time.perf_counter() - tic
        return self.slot_of

    def _free_slot(self, pinned) -> int:
        empty = np.flatnonzero(self.expert_in < 0)
        if len(empty):
            return int(empty[0])
        victim = self.policy.victim(pinned.tolist())
        slot = int(self.slot_of[victim])
        self.slot_of[victim] = -1
        self.expert_in[slot] = -1
        self.policy.forget(victim)
        self.stats.evictions += 1
        return slot

    def _load(self, expert: int, slot: int):
        record = self.layer.records[expert]
        buffers = [self._rows[t.name][slot] for t in self.layer.tensors]
        where = f"{self.store.pack.experts_path}: layer {self.layer.index} expert {expert}"
        try:
            n = os.preadv(self.store.fd, buffers, record.offset)
        except OSError as e:
            raise PackError(f"{where}: read failed ({e})") from e
        if n != record.length:
            raise PackError(f"{where}: short read (expected {record.length} bytes, "
                            f"got {n}); the file is truncated")
        crc = 0
        for b in buffers:
            crc = zlib.crc32(b, crc)
        if crc != record.crc32:
            raise PackError(f"{where}: checksum mismatch (expected {record.crc32:08x}, "
                            f"found {crc:08x})")
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.stats.loads += 1
        self.stats.bytes_read += n


def _slot_array(num_slots: int, shape, dtype: str):
    """An MLX array of (num_slots, *shape) and a writable numpy view of its memory."""
    storage = {"bfloat16": np.uint16}.get(dtype, dtype)
    host = mx.array(np.zeros((num_slots, *shape), dtype=storage))
    mx.eval(host)
    view = np.asarray(host)  # shares the MLX buffer: preadv into it fills the array
    array = host.view(mx.bfloat16) if dtype == "bfloat16" else host
    return array, view


class ExpertStore:
    """All MoE layers' slot pools for one pack, under one memory budget."""

    def __init__(self, pack: Pack, expert_budget=1.0, cache_policy: str = DEFAULT_POLICY):
        self.fd = -1
        self.pack = pack
        self.budget_bytes = parse_budget(expert_budget, pack.expert_bytes)
        per_slot = sum(l.expert_bytes for l in pack.layers)  # one slot in every layer
        minimum = self.minimum_budget(pack)
        if self.budget_bytes < minimum:
            raise BudgetError(
                f"expert budget {_fmt_bytes(self.budget_bytes)} cannot hold one layer's "
                f"top-{pack.top_k} experts in every MoE layer; the minimum is "
                f"{_fmt_bytes(minimum)} ({minimum} bytes, "
                f"{minimum / pack.expert_bytes:.1%} of the routed experts)"
            )
        max_experts = min(l.num_experts for l in pack.layers)
        self.slots_per_layer = min(self.budget_bytes // per_slot, max_experts)
        self.stats = ExpertStats()
        self.trace: Optional[TraceRecorder] = None
        self.fd = os.open(pack.experts_path, os.O_RDONLY)
        self.layers: Dict[str, LayerSlots] = {
            l.module: LayerSlots(self, l, self.slots_per_layer, cache_policy)
            for l in pack.layers
        }

    def start_trace(self) -> TraceRecorder:
        """Record the routing of every forward call from now on."""
        self.trace = TraceRecorder([l.index for l in self.pack.layers],
                                   [l.expert_bytes for l in self.pack.layers])
        return self.trace

    @staticmethod
    def minimum_budget(pack: Pack) -> int:
        """Bytes for top-k slots in every MoE layer: one token's experts."""
        return pack.top_k * sum(l.expert_bytes for l in pack.layers)

    @property
    def slot_bytes(self) -> int:
        """Memory the slot pools hold."""
        return self.slots_per_layer * sum(l.expert_bytes for l in self.pack.layers)

    def close(self):
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
