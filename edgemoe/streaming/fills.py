"""A pool's fills, the half of the slot state machine that the reader drives: a slot is
claimed for an expert (a free one, else the cache policy's victim), its fill handed to the
reader (edgemoe.streaming.reads.Fill), waited for, and ended by the reader thread: the
slot ready, or free again. SlotFills is a part of LayerSlots (edgemoe.streaming.slots),
which holds the state and runs the calls. This module needs neither MLX nor PyTorch.
"""

import threading
import time
from typing import List, Optional

import numpy as np

from ..format.pack import PackError
from .reads import Fill

FREE, FILLING, READY = range(3)  # a slot's states (one in use is ready: LayerSlots.in_use)
WAIT_POLL_S = 0.05  # how often a waiting compute checks the reader and its deadline


class SlotFills:
    """How LayerSlots claims, fills, waits for and gives up slots (its state: LayerSlots').
    The caller holds the pool's lock where a method says so."""

    def _start_fill(self, expert: int, pinned, prefetch: bool = False,
                    room: Optional["Room"] = None) -> Fill:
        """Claim a slot for `expert` (the caller holds the lock) and describe its fill;
        `room`: the call's free slots and evictable experts, found once (`Room`)."""
        if self.layer.records[expert] is None:
            raise PackError(f"layer {self.layer.index} expert {expert}: another host's "
                            f"(this host holds only its share)")
        free = free_slots(self._states) if room is None else room.free
        if free:
            # with a slot for every expert, each goes to its own (the layer's table is
            # then the identity: a resident call takes the router's ids as they are)
            own = self.num_slots >= self.layer.num_experts and self._states[expert] == FREE
            slot = expert if own else free[0]
            free.remove(slot)
        else:
            victim = self._victim(pinned) if room is None else room.victim(self, pinned)
            slot = self.slot_ints[victim]
            self.slot_ints[victim] = -1
            self.ready.discard(victim)
            self.policy.forget(victim)
            self.stats.evictions += 1
            if victim in self.prefetched:  # read ahead and never used
                self.prefetched.discard(victim)
                self.stats.prefetch_wasted_bytes += self.expert_bytes
                self.wasted_bytes += self.expert_bytes
            if prefetch:
                self.evicted_for_prefetch.add(victim)
        try:
            buffers = self.memory.stage(slot, expert)
        except BaseException:  # no fill: the slot is free (a victim's is given up)
            self._expert[slot] = -1
            self._states[slot] = FREE
            raise
        self.slot_ints[expert] = slot
        self._expert[slot] = expert
        self._states[slot] = FILLING
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

    def _submit(self, fills: List[Fill]):
        """Fills whose record a host tier holds are done by a copy; the reader reads the
        others."""
        reads = [f for f in fills if f.buffers is not None]
        for f in fills:
            if f.buffers is None:
                self._filled(f, 0, None)
        if reads:
            self.reader.submit(reads)

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
                self._states[fill.slot] = FREE
                # a whole layer's reads (`release`) may have found this slot taken: read
                # the rest now, or the layer would wait for its next call to turn resident
                rest = self.unheld_of_whole_layer()
            else:
                rest = None
                self.fills.pop(fill.expert, None)
                if error is None:
                    self._states[fill.slot] = READY
                    self.ready.add(fill.expert)
                    self.stats.bytes_read += nbytes
                    self.bytes_read += nbytes
                else:
                    self.slot_ints[fill.expert] = -1
                    self._expert[fill.slot] = -1
                    self._states[fill.slot] = FREE
                    self.policy.forget(fill.expert)
                    fill.error = error
            fill.ended = True
            fill.latch.release()
        if rest:
            self._fill_ahead(np.array(rest))

    def _wait(self, fills, raise_errors=True):
        """Until `fills` have ended (each releases its latch: `_filled`); their first
        error."""
        if all(f.ended for f in fills):  # (the reads are done: no wait, no time blocked)
            for f in fills:
                if f.error is not None and raise_errors:
                    raise f.error
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
        """The experts in ready slots, neither pinned, nor being read, nor in use (a ready
        slot always holds an expert): kept as a set (`ready`), as this runs for each call
        that misses."""
        return self.ready.difference(pinned, self.fills,
                                     map(self._expert.__getitem__, self.in_use))

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


class Room:
    """Where a call's misses can go: the pool's free slots (lowest first) and its evictable
    experts, found once under the lock and kept as the call's fills claim them (nothing
    else changes them while the lock is held), so that a miss costs no scan of the slots.
    The policy ranks the evictable experts once, where it can (`rank`): a call's touches
    are of its own experts, never evictable, so the ranking holds for the whole call; a call
    that gives up one expert asks the policy for it alone (the ranking's first).
    `needed`: how many fills the call claims, where known."""

    def __init__(self, pool: SlotFills, pinned, needed: Optional[int] = None):
        self.memory, self.policy, self.rank = pool.memory, pool.policy, pool.rank_victims
        self.free = free_slots(pool._states)
        self.candidates = pool._evictable(pinned)
        self._ranked: Optional[list] = None
        if needed is not None and needed - len(self.free) <= 1:
            self.rank = None  # (one victim at most)

    def fits(self, expert: int) -> bool:
        """A free slot or an evictable expert, and room in the memory for `expert`."""
        return bool(self.free or self.candidates) and self.memory.has_room(expert)

    def fits_all(self, experts: list) -> bool:
        """Every one of `experts` finds a slot (as `fits`, one after another)."""
        return len(self.free) + len(self.candidates) >= len(experts) \
            and self.memory.has_room_for(experts)

    def victim(self, pool: SlotFills, pinned) -> int:
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


def free_slots(states: bytearray) -> List[int]:
    """The free slots, lowest first, of a pool's states (a bytearray: C scans)."""
    free, at = [], states.find(FREE)
    while at >= 0:
        free.append(at)
        at = states.find(FREE, at + 1)
    return free


def defined_with(policy, name: str, owner_of: str):
    """The policy's method `name` where the class that defines its `owner_of` defines it
    too (a shortcut that a subclass changing `owner_of` alone would make wrong); else
    None."""
    owner = next((c for c in type(policy).__mro__ if owner_of in c.__dict__), None)
    return getattr(policy, name) if owner is not None and name in owner.__dict__ else None
