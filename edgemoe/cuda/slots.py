"""Slot memory in device memory, filled from the layer's host tier by asynchronous copies.

Each slot has a device row, one record long; the per-tensor slot arrays that compute
reads are views of the device rows. A record reaches a slot through a row of the layer's
HostTier (edgemoe.cuda.host): the reader `preadv`s it into the row, or the row still
holds it (a host hit); then one copy moves it to the device row on a copy stream and an
event marks it done. The rules that keep this correct without ever stopping the compute
stream from the host (the tier adds its own two, A and B, about its rows):

1. compute waits (on the GPU) for a slot's copy event before reading the slot;
2. a slot's next copy waits (on its copy stream) for the event recorded on the compute
   stream when the computation that last read the slot was issued.

With several copy streams (`streams.lanes`), a slot's copies all go on one of them, so
that a refill waiting on compute (rule 2) holds up only the copies behind it on its
stream, not every copy.
"""

from typing import Dict, List, Optional

import numpy as np
import torch

from ..format.pack import PackLayer
from .host import HostTier

TORCH_DTYPES = {"uint32": torch.int32,  # the same bits; see int4.py
                "float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


class DeviceSlotMemory:
    """A layer's slots for edgemoe.streaming.slots.LayerSlots, on `device`, fed by `host` (a tier
    of `host_rows` rows by default), ordered by `streams`."""

    def __init__(self, layer: PackLayer, num_slots: int, device, streams,
                 host: Optional[HostTier] = None):
        self.streams = streams
        self.host = host or HostTier(layer, num_slots, streams)
        self.device_rows = torch.zeros((num_slots, layer.expert_bytes), dtype=torch.uint8,
                                       device=device)
        self.arrays: Dict[str, torch.Tensor] = {
            t.name: _tensor_view(self.device_rows, t) for t in layer.tensors}
        self.source = [None] * num_slots  # (host row, hit) of the slot's fill in flight
        self.copied = [None] * num_slots  # event: the slot's latest copy is done
        self.last_read = [None] * num_slots  # event: the computation last reading it is done
        self.awaited = [False] * num_slots  # the compute stream already waits on `copied`

    def has_room(self, expert: int) -> bool:
        return self.host.has_room(expert)

    def has_room_for(self, experts: list) -> bool:
        return self.host.has_room_for(experts)

    def stage(self, slot: int, expert: int) -> Optional[List[np.ndarray]]:
        row, buffers = self.host.stage(expert)
        self.source[slot] = (row, buffers is None)
        return buffers

    def before_read(self, slot: int):
        self.host.before_read(self.source[slot][0])  # the tier's rule B

    def after_read(self, slot: int):
        """The slot's record is in its host row: copy it to the device (the tier's rule
        A: only now, once the read has completed)."""
        row, _ = self.source[slot]
        lane = slot % self.streams.lanes
        if self.last_read[slot] is not None:  # rule 2
            self.streams.copy_wait(self.last_read[slot], lane)
        self.streams.copy(self.device_rows[slot], self.host.buffer[row], lane)
        self.copied[slot] = self.streams.record_copy(lane)
        self.host.queued(row, self.copied[slot])
        self.awaited[slot] = False
        self.source[slot] = None

    def abandon(self, slot: int):
        if self.source[slot] is not None:
            self.host.abandon(*self.source[slot])
            self.source[slot] = None

    def acquire(self, slots: List[int]):
        for slot in np.unique(slots).tolist():  # rule 1; once per fill, streams are in order
            if not self.awaited[slot] and self.copied[slot] is not None:
                self.streams.compute_wait(self.copied[slot])
            self.awaited[slot] = True

    def release(self, slots: List[int]):
        if len(slots):
            event = self.streams.record_compute()
            for slot in slots:
                self.last_read[slot] = event


def _tensor_view(rows: torch.Tensor, t) -> torch.Tensor:
    """(num_slots, *t.shape) view of one tensor inside every slot's record."""
    part = rows[:, t.offset:t.offset + t.nbytes].view(TORCH_DTYPES[t.dtype])
    return part.unflatten(1, t.shape)
