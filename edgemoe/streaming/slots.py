"""The slot interface: one MoE layer's fixed pool of expert slots and its state machine.

A slot is free, filling (the reader is writing it) or ready; a ready slot may be in use
by the current call (`in_use`: a computation reads it, until `release`). Compute asks
`ensure(experts)` for a slot table; missing experts are read on demand and waited for. A
prediction may `prefetch` a layer's experts ahead of time (advice must earn it:
edgemoe.streaming.prefetch). The cache policy picks which ready slot to give up; filling
and in-use slots are never evicted (edgemoe.streaming.fills).
Where a slot's bytes live is a backend's SlotMemory (edgemoe.streaming.memory). This
module needs neither MLX nor PyTorch.
"""

import threading
from typing import Callable, Dict, List, Optional, Protocol

import numpy as np

from ..format.pack import PackLayer
from .fills import FILLING, READY, Room, defined_with
from .memory import SlotMemory
from .prefetch import WASTE_DECAY, Prefetching
from .reads import Fill
from .stats import ExpertStats


class SlotPool(Protocol):
    """The seam between policy and hardware, one per MoE layer.

    `ensure` returns the expert -> slot table (-1 where absent) with every requested
    expert ready and marked in use; `release` ends that use once the computation that
    read the slots has finished (or failed: see edgemoe.streaming.calls); `prefetch`
    starts fills without waiting, for this layer's next call (`lead=0`) or the one
    after (`lead=1`); `read_ahead` starts the fills of the current call's next pass.
    """

    num_slots: int

    def ensure(self, experts: np.ndarray, new_call: bool = True) -> np.ndarray: ...

    def release(self) -> None: ...

    def prefetch(self, experts: np.ndarray, lead: int = 0) -> None: ...

    def read_ahead(self, experts: np.ndarray) -> None: ...


class LayerSlots(Prefetching):
    """The slot pool of one MoE layer: its state machine over a backend's SlotMemory. Here
    its state and its calls (ensure, release, a call's passes); its fills and its
    predictions are its parts SlotFills and Prefetching.

    `reader` takes fills (`submit`) and says whether it still runs (`alive`); `stats`
    and `lock` are shared by every layer of one store.
    """

    def __init__(self, layer: PackLayer, num_slots: int, policy, memory: SlotMemory,
                 reader, stats: ExpertStats, lock: threading.Lock):
        self.layer, self.num_slots, self.policy = layer, num_slots, policy
        self.memory, self.reader, self.stats, self.lock = memory, reader, stats, lock
        self.expert_bytes = layer.expert_bytes  # (a sum over the tensors: asked per call)
        # the policy's `victim_among`, where the class that defines its `victim` defines it
        # too (a subclass that changes `victim` alone is asked by `victim`); found once: it
        # walks the classes
        self.victim_among = defined_with(policy, "victim_among", "victim")
        # the policy's ranking of a call's victims, where it is its `victim_among`'s
        self.rank_victims = defined_with(policy, "rank", "victim_among") \
            if self.victim_among is not None else None
        # the policy's touch of a call's experts at once, where its `touch` class has one
        self.touch_all = defined_with(policy, "touch_all", "touch") or \
            (lambda experts: [policy.touch(e) for e in experts])
        self.in_use: List[int] = []  # the slots the current call uses
        self.owned = layer.owned  # all experts, or one host's share (edgemoe.distributed)
        # The state is numpy arrays for what scans it, and memoryviews of the same memory
        # for a decode call's few entries (`slot_ints`, `_expert`, `_states`: Python ints,
        # no numpy call: after each routing sync the host's caches are cold, and a numpy
        # call then costs ~30 us on these machines against ~1 us for a memoryview's item).
        self.share_slot_table(np.full(layer.num_experts, -1, dtype=np.int64))
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)
        self._expert = memoryview(self.expert_in)
        self._states = bytearray(num_slots)  # (FREE is 0)
        self.state = np.frombuffer(self._states, dtype=np.int8)  # (writable: a bytearray's)
        self.ready: set = set()  # the experts in ready slots (evictable, but those in use)
        self.fills: Dict[int, Fill] = {}  # expert -> its fill in flight
        self.cancelled: List[Fill] = []  # fills cancelled unread, their slots not yet free
        self.pending_prediction: Optional[set] = None  # for this layer's next call
        self.next_prediction: Optional[set] = None  # for the call after
        self.staged: set = set()  # read ahead for a later pass of the current call
        self.on_demand = 0  # this layer's share of stats.on_demand
        self.trace = None  # a TraceRecorder while the store records (ExpertStore.start_trace)
        self.read_timeout_s: Optional[float] = None  # a wait for a fill longer than this fails
        self.gated = False  # advisory predictions: prefetch only while they prove right
        self.scored, self.precision = 0, 0.0  # predictions scored; their running precision
        self.prefetched: set = set()  # read by a prefetch, not requested since
        self.evicted_for_prefetch: set = set()  # evicted to make room for a prefetch
        self.last_call: set = set()  # the experts this layer's last call requested
        self.bytes_read = 0.0  # by this layer's fills, lately (WASTE_DECAY)
        self.wasted_bytes = 0.0  # by its prefetches: read unused, or re-reads they caused
        # settles the device work that still reads this layer's held slots (and other
        # layers'): the model side's (edgemoe.mlx_backend.hostsync); False when there is none
        self.flush: Optional[Callable[[], bool]] = None
        self._resident = False  # once every expert is ready in a slot, for good
        self.identity = False  # resident, each expert in its own slot (`_start_fill`)
        self.read_whole = False  # with a slot for every expert, read them all (`release`)

    def share_slot_table(self, slot_of: np.ndarray):
        """Keep the expert -> slot table in `slot_of` (e.g. a view of device memory:
        edgemoe.mlx_backend.slots.live_table), with the table's entries copied in."""
        if hasattr(self, "slot_of"):
            slot_of[:] = self.slot_of
        self.slot_of, self.slot_ints = slot_of, memoryview(slot_of)

    @property
    def arrays(self) -> Dict[str, object]:
        """The slot tensors compute reads: name -> (num_slots, *shape)."""
        return self.memory.arrays

    @property
    def resident(self) -> bool:
        """Every expert of the layer is ready in a slot and nothing is being read: no call
        can miss, so none needs the routing on the host. With a slot for every expert
        nothing is ever evicted, so a resident layer stays resident."""
        if not self._resident and self.num_slots >= self.layer.num_experts:
            with self.lock:
                self._resident = (not self.fills and not self.cancelled
                                  and bool((self.slot_of >= 0).all())
                                  and bool((self.state[self.slot_of] != FILLING).all()))
                self.identity = self._resident and bool(
                    (self.slot_of == np.arange(self.layer.num_experts)).all())
        return self._resident

    def count_resident_hits(self, requested: int):
        """Calls of a resident layer requested this many experts, all hits (counted on the
        device, settled later: edgemoe.mlx_backend.hostsync)."""
        with self.lock:
            self.stats.hits += requested
            self.stats.bytes_hit += requested * self.expert_bytes
            self.stats.bytes_used += requested * self.expert_bytes

    def record_routing(self, ids: np.ndarray):
        """One call's routing, (..., k) expert ids, for the trace if one is recording."""
        if self.trace is not None:
            self.trace.record(self.layer.index, ids)

    def ensure(self, experts, new_call: bool = True) -> np.ndarray:
        """`experts`: distinct, sorted (an array or a list). `new_call=False` for the later
        passes of one call (more experts than slots)."""
        wanted = experts.tolist() if isinstance(experts, np.ndarray) else experts
        assert len(wanted) <= self.num_slots
        if new_call:
            slot_of = self._ensure_plain(wanted)
            if slot_of is not None:
                return slot_of
        waits, missing = [], []
        with self.lock:
            if new_call:
                self._cancel_stale((self.pending_prediction or set()) - set(wanted)
                                   - (self.next_prediction or set()))
                self._score_prediction(wanted)
                self.bytes_read *= WASTE_DECAY
                self.wasted_bytes *= WASTE_DECAY
                self.last_call = set(wanted)
            else:
                self.last_call.update(wanted)
            for e in wanted:
                slot = self.slot_of[e]
                self.prefetched.discard(e)
                if e in self.evicted_for_prefetch:
                    self.evicted_for_prefetch.discard(e)
                    if slot < 0:  # a prefetch took its slot, and now it is needed
                        self.stats.prefetch_evicted_needed += 1
                        self.wasted_bytes += self.expert_bytes
                staged = e in self.staged  # read for this call by read_ahead: not a hit
                self.staged.discard(e)
                if staged and slot >= 0:
                    self.stats.on_demand += 1
                    self.on_demand += 1
                    if e in self.fills:
                        waits.append(self.fills[e])
                elif slot >= 0 and self.state[slot] == READY:
                    self.stats.hits += 1
                    self.stats.bytes_hit += self.expert_bytes
                elif slot >= 0:
                    self.stats.late_fills += 1
                    waits.append(self.fills[e])
                else:
                    missing.append(e)
                self.policy.touch(e)
            self.stats.on_demand += len(missing)
            self.stats.bytes_used += len(wanted) * self.expert_bytes
            self.on_demand += len(missing)
        while missing:
            new, in_flight, stuck = [], [], False
            try:
                with self.lock:
                    room = Room(self, wanted)
                    while missing and room.fits(missing[-1]):
                        new.append(self._start_fill(missing.pop(), pinned=wanted, room=room))
                    if missing:  # every other slot (or host row) is filling: a fill
                        # must land first, a prefetch's if there is one
                        in_flight = [f for e, f in self.fills.items() if e not in wanted] \
                            or self.cancelled[:1] or list(self.fills.values())
                        stuck = not in_flight and not new
            finally:  # a claimed slot is always read, or it would stay filling for ever
                self._submit(new)
            waits += new
            if stuck:  # every slot is held by queued compute: settle it (outside the lock)
                if self.flush is None or not self.flush():
                    raise RuntimeError(
                        f"layer {self.layer.index}: no slot can be had: every slot "
                        f"is in use by a call that was never released")
                continue
            if in_flight:
                self._wait(in_flight[:1], raise_errors=False)
        self._wait(waits)
        with self.lock:
            used = [self.slot_ints[e] for e in wanted]
            self._use(used)
        self.memory.acquire(used)
        return self.slot_of

    def _use(self, slots: List[int], disjoint: bool = False):
        """Mark `slots` in use by the current call (the caller holds the lock); `disjoint`:
        none of them is in use yet. A list, and no state of each slot: that costs a decode
        call nothing per slot, here or at its release (docs/benchmarks.md, session 37)."""
        if not self.in_use:
            self.in_use = list(slots)
        elif disjoint:
            self.in_use += slots
        else:
            self.in_use = sorted(set(self.in_use).union(slots))

    def _ensure_plain(self, wanted: list) -> Optional[np.ndarray]:
        """`ensure` of a call in a layer with nothing in flight and no prediction or
        read-ahead to account for (the common decode step, hits and misses), in a few
        operations: the general path's bookkeeping, slots and victims. None (nothing
        done) for any other call, or when its misses find no room at once."""
        fills = self.claim(wanted)
        if fills is None:
            return None
        self.finish(fills)
        return self.slot_of

    def claim(self, wanted: list) -> Optional[list]:
        """The first half of `ensure`'s plain path (see `_ensure_plain`): the call's hits
        marked in use, its misses' fills started, not waited for; those fills, or None
        (nothing done) where the plain path does not apply. `finish` waits for them."""
        fills = []
        try:
            with self.lock:
                if (self.fills or self.cancelled or self.pending_prediction is not None
                        or self.next_prediction is not None
                        or self.evicted_for_prefetch or self.staged):
                    return None
                # (nothing in flight: a slot that holds an expert is ready)
                used = list(map(self.slot_ints.__getitem__, wanted))
                missing = [] if min(used, default=0) >= 0 else \
                    [e for e, s in zip(wanted, used) if s < 0]
                room = Room(self, wanted, needed=len(missing)) if missing else None
                if missing and not room.fits_all(missing):
                    return None  # slots held by queued compute: the general path settles it
                if self.prefetched:  # (landed prefetches: a long prefill's look-ahead)
                    self.prefetched.difference_update(wanted)  # requested now, as `ensure`
                self.bytes_read *= WASTE_DECAY
                self.wasted_bytes *= WASTE_DECAY
                self.last_call = set(wanted)
                self.touch_all(wanted)
                n_hits = len(wanted) - len(missing)
                self.stats.hits += n_hits
                self.stats.bytes_hit += n_hits * self.expert_bytes
                self.stats.bytes_used += len(wanted) * self.expert_bytes
                self.stats.on_demand += len(missing)
                self.on_demand += len(missing)
                for e in reversed(missing):  # (as the general path: the last first)
                    fills.append(self._start_fill(e, pinned=wanted, room=room))
                hits = [s for s in used if s >= 0] if missing else used
                self._use(hits)
        finally:  # (outside the lock: a fill served from a host tier ends at once)
            if fills:  # a claimed slot is always read, or it stays filling
                self._submit(fills)
        self.memory.acquire(hits)
        return fills

    def finish(self, fills: list):
        """`claim`'s fills have landed: their slots in use too."""
        if fills:
            self._wait(fills)
            with self.lock:
                used = [f.slot for f in fills]  # (the slots the call's misses were given)
                self._use(used, disjoint=True)
            self.memory.acquire(used)

    def release(self):
        with self.lock:
            used, self.in_use = self.in_use, []
            # under the lock: no fill can claim these slots before their release is known
            self.memory.release(used)
            # (`unheld_of_whole_layer`'s test, inline: decode releases every layer's call)
            whole = self.read_whole and not self._resident \
                and self.num_slots >= self.layer.num_experts
            if self.pending_prediction is None and not whole:
                return  # (native decode under a budget: nothing to read ahead)
            # experts predicted for the next call that found no room, or that this
            # call's own loads evicted: read them now, a call ahead still
            missing = [e for e in self.pending_prediction or () if self.slot_of[e] < 0]
            if self.gated and not self.earned:  # (an untrusted prediction is only scored)
                missing = []
            if whole:
                missing = self.unheld_of_whole_layer()
        if missing:
            self._fill_ahead(np.array(sorted(missing)))

    def unheld_of_whole_layer(self) -> Optional[List[int]]:
        """With a slot for every expert, the layer holds them all, as mlx-lm does, so that
        it turns resident and its calls need no routing on the host: the experts it does
        not hold yet (the caller holds the lock). None when it reads no whole layer."""
        if not self.read_whole or self.num_slots < self.layer.num_experts or self._resident:
            return None
        return [e for e in np.flatnonzero(self.slot_of < 0).tolist()
                if self.layer.records[e] is not None]

    def read_ahead(self, experts: np.ndarray):
        """Start reading a later pass's experts of the current call into the slots this
        pass does not use (its own are in use, so never chosen), so that they load while
        this pass computes. They count as loaded on demand when their pass ensures them."""
        new = []
        try:
            with self.lock:
                pinned = set(experts.tolist())
                room = Room(self, pinned)  # (found once: a pass of a long prefill is many)
                for e in experts.tolist():
                    if self.slot_of[e] >= 0:
                        continue
                    if not room.fits(e):
                        break  # its own pass reads the rest
                    new.append(self._start_fill(e, pinned=pinned, room=room))
                    self.staged.add(e)
        finally:
            self._submit(new)
