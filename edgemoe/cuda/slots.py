"""Slot memory in device memory, filled from pinned host rows by asynchronous copies.

Each slot has a host row (page-locked on a GPU) and a device row, each one record long:
the reader `preadv`s a record into the host row, then one copy moves it to the device
row on the copy stream and an event marks it done. The per-tensor slot arrays that
compute reads are views of the device rows. Three rules keep this correct without
ever stopping the compute stream from the host:

1. compute waits (on the GPU) for a slot's copy event before reading the slot;
2. a slot's next copy waits (on the copy stream) for the event recorded on the compute
   stream when the computation that last read the slot was issued;
3. the reader waits (on its own thread) for a host row's previous copy to finish
   before writing the row again.
"""

from typing import Dict, List

import numpy as np
import torch

from ..format.pack import PackLayer

TORCH_DTYPES = {"uint32": torch.int32,  # the same bits; see int4.py
                "float32": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16}


class DeviceSlotMemory:
    """A layer's slots for edgemoe.store.LayerSlots, on `device`, ordered by `streams`."""

    def __init__(self, layer: PackLayer, num_slots: int, device, streams):
        self.streams = streams
        record = layer.expert_bytes
        self.host = torch.zeros((num_slots, record), dtype=torch.uint8,
                                pin_memory=streams.pinned)
        self.device_rows = torch.zeros((num_slots, record), dtype=torch.uint8, device=device)
        self.arrays: Dict[str, torch.Tensor] = {}
        host_views: Dict[str, np.ndarray] = {}
        host_bytes = self.host.numpy()  # shares the host rows' memory
        for t in layer.tensors:
            self.arrays[t.name] = _tensor_view(self.device_rows, t)
            host_views[t.name] = host_bytes[:, t.offset:t.offset + t.nbytes]
        self._rows = [[host_views[t.name][slot].view(_numpy_dtype(t.dtype)).reshape(t.shape)
                       for t in layer.tensors] for slot in range(num_slots)]
        self.copied = [None] * num_slots  # event: the slot's latest copy is done
        self.last_read = [None] * num_slots  # event: the computation last reading it is done
        self.awaited = [False] * num_slots  # the compute stream already waits on `copied`

    def rows(self, slot: int) -> List[np.ndarray]:
        return self._rows[slot]

    def before_read(self, slot: int):
        if self.copied[slot] is not None:  # rule 3
            self.streams.host_wait(self.copied[slot])

    def after_read(self, slot: int):
        if self.last_read[slot] is not None:  # rule 2
            self.streams.copy_wait(self.last_read[slot])
        self.streams.copy(self.device_rows[slot], self.host[slot])
        self.copied[slot] = self.streams.record_copy()
        self.awaited[slot] = False

    def acquire(self, slots: np.ndarray):
        for slot in np.unique(slots).tolist():  # rule 1; once per fill, streams are in order
            if not self.awaited[slot] and self.copied[slot] is not None:
                self.streams.compute_wait(self.copied[slot])
            self.awaited[slot] = True

    def release(self, slots: np.ndarray):
        if len(slots):
            event = self.streams.record_compute()
            for slot in slots.tolist():
                self.last_read[slot] = event


def _tensor_view(rows: torch.Tensor, t) -> torch.Tensor:
    """(num_slots, *t.shape) view of one tensor inside every slot's record."""
    part = rows[:, t.offset:t.offset + t.nbytes].view(TORCH_DTYPES[t.dtype])
    return part.unflatten(1, t.shape)


def _numpy_dtype(dtype: str):
    return {"bfloat16": np.uint16}.get(dtype, np.dtype(dtype))  # the reader writes bytes
