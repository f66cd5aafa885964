"""The host-memory tier: one MoE layer's expert records in (pinned) RAM, between the disk
and the device slots (SSD -> RAM -> VRAM, as SSD-LLaMA and MoE-Infinity keep them).

Every record bound for a device slot passes through one of the layer's host rows: the
reader `preadv`s it into a row, and the slot memory (edgemoe.cuda.slots) copies the row
to the device. A row keeps its record afterwards, so a device slot missing an expert
that a row still holds costs one copy, not a read (a host hit). Which ready row to give
up for a new record is the tier's own cache policy's choice (edgemoe.streaming.cache).

The tier has at least STAGING_ROWS(top-k) rows: with no `--host-budget` it is the
bounded pinned staging ring that the copies need (pinned memory a few records large,
not the size of the slot memory), and still serves the hits it can. Two rules:

A. a record is copied from a row only once its read has completed, and the row keeps
   it until that copy is queued: a row being read is neither a hit nor evictable, a hit
   claims its row until its copy is queued (`stage`, `queued`), and the slot memory
   issues a read's copy only in `after_read`, after the reader wrote and checked it;
B. a row is never rewritten while a queued copy still reads it: the reader waits
   (`before_read`, on its own thread) for the row's last copy event first.
"""

import threading
from typing import List, Optional, Tuple

import numpy as np
import torch

from ..format.pack import PackLayer
from ..streaming.cache import DEFAULT_POLICY, make_policy

FREE, READING, READY = range(3)


def staging_rows(top_k: int) -> int:
    """The fewest rows a layer's tier has: one token's experts can be read at once."""
    return max(2, top_k)


class HostTier:
    """Host rows of one layer's records; `streams` orders copies (edgemoe.cuda.streams)."""

    def __init__(self, layer: PackLayer, num_rows: int, streams, policy=DEFAULT_POLICY):
        self.streams, self.policy = streams, make_policy(policy)
        self.buffer = torch.zeros((num_rows, layer.expert_bytes), dtype=torch.uint8,
                                  pin_memory=streams.pinned)
        as_bytes = self.buffer.numpy()  # shares the rows' memory: the reader writes here
        self._views = [[as_bytes[row, t.offset:t.offset + t.nbytes].view(_numpy_dtype(t.dtype))
                        .reshape(t.shape) for t in layer.tensors] for row in range(num_rows)]
        self.expert_in = np.full(num_rows, -1, dtype=np.int64)
        self.state = np.full(num_rows, FREE, dtype=np.int8)
        self.row_of = {}  # expert -> the READY row holding its record
        self.claims = np.zeros(num_rows, dtype=np.int64)  # hits whose copy is not queued yet
        self.copies = [[] for _ in range(num_rows)]  # events of the copies reading each row
        self.lock = threading.Lock()

    @property
    def num_rows(self) -> int:
        return len(self.state)

    def has_room(self, expert: int) -> bool:
        """Whether `stage(expert)` can be served now without waiting for a read."""
        with self.lock:
            return expert in self.row_of or bool(len(self._evictable()))

    def has_room_for(self, experts: list) -> bool:
        """Whether `stage` can serve every one of `experts`, one after another, without
        waiting: a row for each expert not in the tier, among the evictable rows that none
        of the others' hits claims."""
        with self.lock:
            held = {self.row_of[e] for e in experts if e in self.row_of}
            new = sum(e not in self.row_of for e in experts)
            return new <= len(set(self._evictable().tolist()) - held)

    def stage(self, expert: int) -> Tuple[int, Optional[List[np.ndarray]]]:
        """(row, None) when a row holds the record (a hit), else (row, buffers to read it
        into): a free row, or the policy's choice among ready rows that no hit has
        claimed (rule A: never one being read). The caller checked `has_room`."""
        with self.lock:
            self.policy.touch(expert)
            if expert in self.row_of:
                row = self.row_of[expert]
                self.claims[row] += 1  # kept until its copy is queued (`queued`)
                return row, None
            free = np.flatnonzero(self.state == FREE)
            if len(free):
                row = int(free[0])
            else:
                evictable = set(self.expert_in[self._evictable()].tolist())
                victim = self.policy.victim([e for e in self.expert_in.tolist()
                                             if e not in evictable] + [expert])
                if victim not in evictable:
                    raise RuntimeError(f"host tier: victim {victim} is not an evictable row")
                row = self.row_of.pop(victim)
                self.policy.forget(victim)
            self.expert_in[row] = expert
            self.state[row] = READING
            return row, self._views[row]

    def before_read(self, row: int):
        """Rule B, on the reader's thread: every copy that read the row has run."""
        with self.lock:
            events, self.copies[row] = self.copies[row], []
        for event in events:
            if event is not None:
                self.streams.host_wait(event)

    def queued(self, row: int, event):
        """A copy reading `row` is queued; `event` marks when it has run. A row that was
        being read now holds its record (it became evictable only now, with the copy's
        event known to rule B)."""
        with self.lock:
            self.copies[row].append(event)
            if self.state[row] == READING:
                self.state[row] = READY
                self.row_of[int(self.expert_in[row])] = row
            else:
                self.claims[row] -= 1

    def abandon(self, row: int, hit: bool):
        """The fill staged at `row` failed: a read leaves the row empty, a hit its claim."""
        with self.lock:
            if hit:
                self.claims[row] -= 1
            elif self.state[row] == READING:
                self.policy.forget(int(self.expert_in[row]))
                self.state[row] = FREE
                self.expert_in[row] = -1

    def held(self) -> int:
        """Records the tier holds."""
        with self.lock:
            return len(self.row_of)

    def _evictable(self) -> np.ndarray:
        return np.flatnonzero((self.state == FREE) | ((self.state == READY) & (self.claims == 0)))


def _numpy_dtype(dtype: str):
    return np.uint16 if dtype == "bfloat16" else np.dtype(dtype)  # the reader writes bytes
