"""The slot interface: one MoE layer's fixed pool of expert slots and its state machine.

A slot is free, filling (the reader is writing it), ready, or in use (a computation
reads it). Compute asks `ensure(experts)` for a slot table; missing experts are read on
demand and waited for. A prediction may `prefetch` a layer's experts ahead of time.
An advisory prediction (`gated`: the router still decides) must earn it: each layer
scores its predictions against what its calls then request, and prefetches only while
enough of them were used (MIN_PRECISION, after TRUST_AFTER calls) and while what its
prefetches wasted stays within WASTE_BUDGET of the bytes it read: a prefetch evicted
unused, or one that evicted an expert a call then had to read again, is waste. Where
reads dominate, a wrong guess costs its bytes and a right one saves little (the read
would have happened anyway), so the budget, not the precision, is what keeps advisory
from losing to on demand. Until a layer trusts its predictions it reads nothing for
them, so a bad predictor costs no bytes and evicts nothing. Even a trusted guess never
evicts what the layer's last call used.
The cache policy picks which ready slot to give up; filling and in-use slots are never
evicted. Where a slot's bytes live is a backend's `SlotMemory`: MLX arrays in unified
memory (edgemoe.model.experts), device tensors filled from pinned host rows
(edgemoe.cuda.slots), or nothing at all (edgemoe.streaming.replay runs traces through this
very state machine). This module needs neither MLX nor PyTorch.
"""

import threading
import time
from typing import Callable, Dict, List, Optional, Protocol

import numpy as np

from ..format.pack import PackError, PackLayer
from .reader import Fill
from .stats import ExpertStats

FREE, FILLING, READY, IN_USE = range(4)
WAIT_POLL_S = 0.05  # how often a waiting compute checks the reader and its deadline
MIN_PRECISION = 0.5  # of a layer's recent advisory predictions used, to prefetch for it
TRUST_AFTER = 4  # calls whose predictions a layer scores before it may trust them
PRECISION_DECAY = 0.8  # weight of the past in a layer's running precision
WASTE_BUDGET = 0.05  # of a layer's bytes read, what its advisory prefetches may waste
WASTE_DECAY = 0.99  # per call: both tallies look back some 100 calls (a prefill's reads fade)


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


class SlotMemory(Protocol):
    """The bytes of one layer's slots, and the ordering a device needs around them.

    `arrays` are what compute reads: tensor name -> (num_slots, *shape). When a slot is
    claimed for an expert, `stage(slot, expert)` says where the reader writes its record
    (host buffers, in the layer's tensor order), or None when the memory already holds
    the record in a host tier (then the fill is a copy, not a read). The reader calls
    `before_read(slot)`, writes the buffers, then calls `after_read(slot)`; a slot turns
    ready only after that (a fill served from the host tier gets `after_read` alone). A
    fill that fails gets `abandon(slot)` instead. `has_room(expert)` is False while the
    memory cannot stage that expert now (its host rows are all being read into);
    `has_room_for(experts)`, whether it can stage them all, one after another. Compute
    calls `acquire(slots)` before reading slots and `release(slots)` once its reads are
    issued; a slot is refilled only after its release.
    """

    arrays: Dict[str, object]

    def stage(self, slot: int, expert: int) -> Optional[List[np.ndarray]]: ...

    def has_room(self, expert: int) -> bool: ...

    def has_room_for(self, experts: list) -> bool: ...

    def before_read(self, slot: int) -> None: ...

    def after_read(self, slot: int) -> None: ...

    def abandon(self, slot: int) -> None: ...

    def acquire(self, slots: np.ndarray) -> None: ...

    def release(self, slots: np.ndarray) -> None: ...


class UnorderedMemory:
    """Slot memory that the reader fills in place (`rows(slot)`), and whose reads and
    compute need no ordering hooks (host memory, where compute finishes its reads before
    it releases slots)."""

    def stage(self, slot: int, expert: int) -> List[np.ndarray]:
        return self.rows(slot)

    def has_room(self, expert: int) -> bool:
        return True

    def has_room_for(self, experts: list) -> bool:
        return True

    def before_read(self, slot: int):
        pass

    def after_read(self, slot: int):
        pass

    def abandon(self, slot: int):
        pass

    def acquire(self, slots: np.ndarray):
        pass

    def release(self, slots: np.ndarray):
        pass


class NoMemory(UnorderedMemory):
    """Slot memory that holds nothing: the state machine alone (trace replays)."""

    arrays: Dict[str, object] = {}

    def rows(self, slot: int) -> List[np.ndarray]:
        return []


# makes a layer's slot memory: (layer, number of slots) -> SlotMemory
MemoryFactory = Callable[[PackLayer, int], SlotMemory]


class LayerSlots:
    """The slot pool of one MoE layer: its state machine over a backend's SlotMemory.

    `reader` takes fills (`submit`) and says whether it still runs (`alive`); `stats`
    and `lock` are shared by every layer of one store.
    """

    def __init__(self, layer: PackLayer, num_slots: int, policy, memory: SlotMemory,
                 reader, stats: ExpertStats, lock: threading.Lock):
        self.layer, self.num_slots, self.policy = layer, num_slots, policy
        self.memory, self.reader, self.stats, self.lock = memory, reader, stats, lock
        self.expert_bytes = layer.expert_bytes  # (a sum over the tensors: asked per call)
        # the policy's ranking of a call's victims, where it is its `victim_among`'s
        self.victim_among = _victim_among(policy)  # (found once: it walks the classes)
        self.rank_victims = _defined_with(policy, "rank", "victim_among") \
            if self.victim_among is not None else None
        # the policy's touch of a call's experts at once, where its `touch` class has one
        self.touch_all = _defined_with(policy, "touch_all", "touch") or \
            (lambda experts: [policy.touch(e) for e in experts])
        self.in_use = np.zeros(0, dtype=np.int64)  # the slots the current call uses
        self.slot_of = np.full(layer.num_experts, -1, dtype=np.int64)
        self.owned = layer.owned  # all experts, or one host's share (edgemoe.distributed)
        self.expert_in = np.full(num_slots, -1, dtype=np.int64)
        self.state = np.full(num_slots, FREE, dtype=np.int8)
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
        # layers'): the model side's (edgemoe.model.hostsync); False when there is none
        self.flush: Optional[Callable[[], bool]] = None
        self._resident = False  # once every expert is ready in a slot, for good
        self.read_whole = False  # with a slot for every expert, read them all (`release`)

    @property
    def earned(self) -> bool:
        """Whether advisory predictions have earned their reads: enough of them used, and
        what prefetches wasted within the waste budget."""
        return (self.scored >= TRUST_AFTER and self.precision >= MIN_PRECISION
                and self.wasted_bytes <= WASTE_BUDGET * self.bytes_read)

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
        return self._resident

    def count_resident_hits(self, requested: int):
        """Calls of a resident layer requested this many experts, all hits (counted on the
        device, settled later: edgemoe.model.hostsync)."""
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
                elif slot >= 0 and self.state[slot] in (READY, IN_USE):
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
                    room = _Room(self, wanted)
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
            used = self.slot_of[wanted]
            self._use(used)
        self.memory.acquire(used)
        return self.slot_of

    def _use(self, slots: np.ndarray, disjoint: bool = False):
        """Mark `slots` in use by the current call (the caller holds the lock); `disjoint`:
        none of them is in use yet."""
        self.state[slots] = IN_USE
        if not self.in_use.size:
            self.in_use = slots
        else:
            self.in_use = np.concatenate([self.in_use, slots]) if disjoint else \
                np.union1d(self.in_use, slots)

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
                        or self.next_prediction is not None or self.prefetched
                        or self.evicted_for_prefetch or self.staged):
                    return None
                used = self.slot_of[wanted]
                hit = used >= 0  # (nothing in flight: a slot that holds an expert is ready)
                missing = [] if hit.all() else [e for e, h in zip(wanted, hit.tolist())
                                                if not h]
                room = _Room(self, wanted, needed=len(missing)) if missing else None
                if missing and not room.fits_all(missing):
                    return None  # slots held by queued compute: the general path settles it
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
                hits = used[hit] if missing else used
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
                used = self.slot_of[[f.expert for f in fills]]
                self._use(used, disjoint=True)  # (slots the call's misses were given)
            self.memory.acquire(used)

    def release(self):
        with self.lock:
            used, self.in_use = self.in_use, self.in_use[:0]
            # under the lock: no fill can claim these slots before their release is known
            self.memory.release(used)
            self.state[used] = READY
            # experts predicted for the next call that found no room, or that this
            # call's own loads evicted: read them now, a call ahead still
            missing = [e for e in self.pending_prediction or () if self.slot_of[e] < 0]
            if self.gated and not self.earned:  # (an untrusted prediction is only scored)
                missing = []
            if self.read_whole and self.num_slots >= self.layer.num_experts \
                    and not self._resident:
                # a slot for every expert: hold them all, as mlx-lm does, so that the
                # layer turns resident and its calls need no routing on the host
                missing = [e for e in np.flatnonzero(self.slot_of < 0).tolist()
                           if self.layer.records[e] is not None]
        if missing:
            self._fill_ahead(np.array(sorted(missing)))

    def read_ahead(self, experts: np.ndarray):
        """Start reading a later pass's experts of the current call into the slots this
        pass does not use (its own are in use, so never chosen), so that they load while
        this pass computes. They count as loaded on demand when their pass ensures them."""
        new = []
        try:
            with self.lock:
                pinned = set(experts.tolist())
                room = _Room(self, pinned)  # (found once: a pass of a long prefill is many)
                for e in experts.tolist():
                    if self.slot_of[e] >= 0:
                        continue
                    if not room.fits(e):
                        break  # its own pass reads the rest
                    new.append(self._start_fill(e, pinned=pinned, room=room))
                    self.staged.add(e)
        finally:
            self._submit(new)

    def prefetch(self, experts: np.ndarray, lead: int = 0):
        """Start reading `experts` (a prediction) where slots can be had without waiting.

        `lead` is how many of this layer's calls pass before the predicted one: 0 for a
        prediction about the current token, 1 for one about the next token. What finds
        no room now is read as soon as this layer's current call releases its slots.
        A `gated` pool's predictions are advice: they read only once they have earned it
        (`earned`); else the prediction is the routing itself.
        """
        experts = experts[self.owned[experts]]  # a host reads ahead only its own experts
        with self.lock:
            if lead == 0:
                self.pending_prediction = set(experts.tolist())
            else:
                self.next_prediction = set(experts.tolist())
            trusted = not self.gated or self.earned
        if trusted:  # (an untrusted prediction is only scored)
            self._fill_ahead(experts)

    def _fill_ahead(self, experts: np.ndarray):
        new = []
        try:
            with self.lock:
                # the experts predicted for this layer's next call stay too, and a guess
                # never evicts what the layer's last call used (likely needed again)
                pinned = set(experts.tolist()) | (self.pending_prediction or set())
                if self.gated:  # advice
                    pinned |= self.last_call
                for e in experts.tolist():
                    if self.slot_of[e] >= 0:
                        continue
                    if not self._has_room(pinned, e):
                        break  # release() reads the rest once this layer's call is done
                    if self.gated and not self._worth_a_slot(e, pinned):
                        continue
                    new.append(self._start_fill(e, pinned=pinned, prefetch=True))
                    self.stats.prefetches += 1
                    self.prefetched.add(e)
        finally:
            self._submit(new)

    def _score_prediction(self, wanted):
        if self.pending_prediction:
            used = len(self.pending_prediction.intersection(wanted))
            self.stats.predicted += len(self.pending_prediction)
            self.stats.predicted_used += used
            self.stats.needed += len(wanted)
            share = used / len(self.pending_prediction)
            self.precision = share if not self.scored else \
                PRECISION_DECAY * self.precision + (1 - PRECISION_DECAY) * share
            self.scored += 1
        self.pending_prediction, self.next_prediction = self.next_prediction, None

    def _cancel_stale(self, stale):
        """Prefetches for this call of experts it did not request: those not yet begun are
        dropped unread (the caller holds the lock), so that the reads this call does need
        do not queue behind them. A cancelled fill keeps its slot until the reader ends it."""
        cancel = getattr(self.reader, "cancel", None)
        for e in stale:
            fill = self.fills.get(e)
            if fill is None or e not in self.prefetched or cancel is None or not cancel(fill):
                continue
            del self.fills[e]
            self.cancelled.append(fill)
            self.slot_of[e] = -1
            self.expert_in[fill.slot] = -1
            self.prefetched.discard(e)
            self.policy.forget(e)
            self.stats.prefetch_cancelled += 1

    def _wait(self, fills, raise_errors=True):
        """Until `fills` have ended (each releases its latch: `_filled`); their first
        error."""
        if not fills:
            return
        tic = time.perf_counter()
        try:
            for f in fills:
                while not f.ended:
                    if f.latch.acquire(timeout=WAIT_POLL_S):
                        f.latch.release()  # (open for any other waiter)
                        break
                    if not self.reader.alive():
                        raise RuntimeError("edgemoe: the expert reader thread died")
                    waited = time.perf_counter() - tic
                    if self.read_timeout_s is not None and waited > self.read_timeout_s:
                        raise PackError(
                            f"layer {self.layer.index} expert {f.expert}: the read did "
                            f"not finish within {self.read_timeout_s:g} s "
                            f"(--read-timeout); the disk may be stuck")
        finally:
            with self.lock:
                self.stats.blocked_s += time.perf_counter() - tic
        for f in fills:
            if f.error is not None and raise_errors:
                raise f.error

    def _evictable(self, pinned) -> set:
        """The experts in ready slots, neither pinned nor being read (a ready slot always
        holds an expert): one array operation and a set difference, as this runs for each
        call that misses."""
        return set(self.expert_in[self.state == READY].tolist()).difference(pinned,
                                                                             self.fills)

    def _worth_a_slot(self, expert: int, pinned) -> bool:
        """Whether a guess may have a slot: a free one, or the policy's victim's if the
        policy ranks the guess hotter (never one it would keep over the guess)."""
        if (self.state == FREE).any():
            return True
        heat = getattr(self.policy, "heat", None)
        return heat is not None and heat(expert) > heat(self._victim(pinned))

    def _victim(self, pinned, candidates: Optional[set] = None) -> int:
        """The resident, unpinned, settled expert the policy gives up next (`candidates`:
        those experts, when the caller has them)."""
        if candidates is None:
            candidates = self._evictable(pinned)
        among = self.victim_among
        if among is not None:
            victim = among(candidates)
        else:  # pinned: the experts this step needs, whether resident yet or not
            victim = self.policy.victim([e for e in self.expert_in.tolist()
                                         if e not in candidates] + list(pinned))
        if victim is None or victim not in candidates:
            raise RuntimeError(f"{type(self.policy).__name__}: victim {victim} is not a "
                               f"resident, unpinned expert")
        return victim

    def _has_room(self, pinned, expert: int) -> bool:
        slot_free = bool((self.state == FREE).any()) or bool(self._evictable(pinned))
        return slot_free and self.memory.has_room(expert)

    def _submit(self, fills: List[Fill]):
        """Fills whose record a host tier holds are done by a copy; the reader reads the
        others."""
        reads = [f for f in fills if f.buffers is not None]
        for f in fills:
            if f.buffers is None:
                self._filled(f, 0, None)
        if reads:
            self.reader.submit(reads)

    def _start_fill(self, expert: int, pinned, prefetch: bool = False,
                    room: Optional["_Room"] = None) -> Fill:
        """Claim a slot for `expert` (the caller holds the lock) and describe its fill;
        `room`: the call's free slots and evictable experts, found once (`_Room`)."""
        if self.layer.records[expert] is None:
            raise PackError(f"layer {self.layer.index} expert {expert}: another host's "
                            f"(this host holds only its share)")
        free = np.flatnonzero(self.state == FREE).tolist() if room is None else room.free
        if free:
            slot = free.pop(0)
        else:
            victim = self._victim(pinned) if room is None else room.victim(self, pinned)
            slot = int(self.slot_of[victim])
            self.slot_of[victim] = -1
            self.policy.forget(victim)
            self.stats.evictions += 1
            if victim in self.prefetched:  # read ahead and never used
                self.prefetched.discard(victim)
                self.stats.prefetch_wasted_bytes += self.expert_bytes
                self.wasted_bytes += self.expert_bytes
            if prefetch:
                self.evicted_for_prefetch.add(victim)
        self.slot_of[expert] = slot
        self.expert_in[slot] = expert
        self.state[slot] = FILLING
        buffers = self.memory.stage(slot, expert)
        if buffers is None:  # in the host tier: a copy, no read (see _submit)
            self.stats.host_hits += 1
        latch = threading.Lock()
        latch.acquire()  # (released as the fill ends: `_filled`)
        fill = Fill(self.layer.index, expert, slot, self.layer.records[expert],
                    buffers, self._filled, done=None, latch=latch,
                    before_read=self.memory.before_read)
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
        if error is not None:
            self.memory.abandon(fill.slot)
        with self.lock:
            if fill.cancelled:  # detached when cancelled (_cancel_stale): the slot is free
                self.cancelled.remove(fill)
                self.state[fill.slot] = FREE
                fill.ended = True
                fill.latch.release()
                return
            self.fills.pop(fill.expert, None)
            if error is None:
                self.state[fill.slot] = READY
                self.stats.bytes_read += nbytes
                self.bytes_read += nbytes
            else:
                self.slot_of[fill.expert] = -1
                self.expert_in[fill.slot] = -1
                self.state[fill.slot] = FREE
                self.policy.forget(fill.expert)
                fill.error = error
            fill.ended = True
            fill.latch.release()


class _Room:
    """Where a call's misses can go: the pool's free slots (lowest first) and its evictable
    experts, found once under the lock and kept as the call's fills claim them (nothing
    else changes them while the lock is held), so that a miss costs no scan of the slots.
    The policy ranks the evictable experts once, where it can (`rank`): a call's touches
    are of its own experts, never evictable, so the ranking holds for the whole call; a call
    that gives up one expert asks the policy for it alone (the ranking's first).
    `needed`: how many fills the call claims, where known."""

    def __init__(self, pool: LayerSlots, pinned, needed: Optional[int] = None):
        self.memory, self.policy, self.rank = pool.memory, pool.policy, pool.rank_victims
        self.free = np.flatnonzero(pool.state == FREE).tolist()
        self.candidates = pool._evictable(pinned)
        self._ranked: Optional[list] = None
        if needed is not None and needed - len(self.free) <= 1:
            self.rank = None  # (one victim at most)

    def fits(self, expert: int) -> bool:
        """As `LayerSlots._has_room`."""
        return bool(self.free or self.candidates) and self.memory.has_room(expert)

    def fits_all(self, experts: list) -> bool:
        """Every one of `experts` finds a slot (as `fits`, one after another)."""
        return len(self.free) + len(self.candidates) >= len(experts) \
            and self.memory.has_room_for(experts)

    def victim(self, pool: LayerSlots, pinned) -> int:
        """The policy's choice among the candidates (then no longer one)."""
        rank = self.rank
        if rank is None:
            victim = pool._victim(pinned, self.candidates)
        else:
            if self._ranked is None:
                self._ranked = rank(self.candidates)[::-1]  # the first victim last
            victim = self._ranked.pop()
        self.candidates.discard(victim)
        return victim


def _victim_among(policy):
    """The policy's `victim_among`, where the class that defines its `victim` defines it
    too (a subclass that changes `victim` alone is asked by `victim`); else None."""
    return _defined_with(policy, "victim_among", "victim")


def _defined_with(policy, name: str, owner_of: str):
    """The policy's method `name` where the class that defines its `owner_of` defines it
    too (a shortcut that a subclass changing `owner_of` alone would make wrong); else
    None."""
    owner = next((c for c in type(policy).__mro__ if owner_of in c.__dict__), None)
    return getattr(policy, name) if owner is not None and name in owner.__dict__ else None
