"""The MLX backend's slot memory: a layer's slots as MLX arrays in unified memory, and its
expert -> slot table on the device (`live_table`).

The loader hands it to the store (`ExpertStore(..., memory=MLXSlotMemory)`), as the CUDA
loader hands its DeviceSlotMemory.
"""

from array import array as Array
from typing import Dict

import mlx.core as mx
import numpy as np

from ..format.pack import PackLayer
from ..streaming.memory import UnorderedMemory
from ..streaming.slots import LayerSlots


class MLXSlotMemory(UnorderedMemory):
    """A layer's slots as MLX arrays in unified memory, filled in place: the reader's
    rows are numpy views of the arrays. Compute releases slots only once an evaluation
    that included the computation reading them has returned (edgemoe.mlx_backend.hostsync), so
    no device ordering is needed here."""

    arrays: Dict[str, mx.array]

    def __init__(self, layer: PackLayer, num_slots: int):
        self.arrays, self._rows = {}, {}
        for t in layer.tensors:
            self.arrays[t.name], self._rows[t.name] = _slot_array(num_slots, t.shape, t.dtype)
        self._names = [t.name for t in layer.tensors]
        self._slot_rows = [None] * num_slots  # each slot's rows, made at its first fill

    def rows(self, slot: int):
        rows = self._slot_rows[slot]
        if rows is None:
            rows = self._slot_rows[slot] = [self._rows[name][slot] for name in self._names]
        return rows


def _slot_array(num_slots: int, shape, dtype: str):
    """An MLX array of (num_slots, *shape) and a writable numpy view of its memory."""
    storage = {"bfloat16": np.uint16}.get(dtype, dtype)
    host = mx.array(np.zeros((num_slots, *shape), dtype=storage))
    mx.eval(host)
    view = np.asarray(host)  # shares the MLX buffer: preadv into it fills the array
    array = host.view(mx.bfloat16) if dtype == "bfloat16" else host
    return array, view


def live_table(slots: LayerSlots) -> mx.array:
    """The layer's expert -> slot table on the device, live: the slot state machine's own
    `slot_of` becomes a view of its memory, so that each claim and eviction is in it as it
    is made, with no upload per call. A graph reads only the entries of the experts it
    holds in use, which nothing changes before an evaluation has included it (the slots'
    own rule: edgemoe.mlx_backend.hostsync), as for the slots' bytes."""
    table = mx.array(slots.slot_of.astype(np.int32))
    mx.eval(table)
    slots.share_slot_table(np.asarray(table))  # (shares the MLX buffer, writable)
    return table


class CallSlotIds:
    """A layer's calls' slot ids as the device reads them, made from the host's list
    (`slot_ids_array`); a decode call's (one token: every leading dimension 1) are written
    in place into one uint32 array per shape, so that no array is made per call (made, it
    cost the host ~6 us a MoE layer more: docs/benchmarks.md, session 36). The rule of the
    slots' own bytes and of `live_table` makes this safe: a call writes its ids after its
    routing sync, which has evaluated every graph that read the previous ones (a layer's
    earlier calls are held until a sync has included them: edgemoe.mlx_backend.hostsync)."""

    def __init__(self):
        self._held = {}  # shape -> (the array, a writable view of its memory as uint32s)

    def of(self, slot_ids: list, shape) -> mx.array:
        """`slot_ids`, in the call's (..., k) order, as a uint32 array of `shape`."""
        if len(slot_ids) != shape[-1]:  # (more than one token)
            return slot_ids_array(slot_ids, shape)
        held = self._held.get(shape)
        if held is None:
            array = mx.array(np.zeros(shape, dtype=np.uint32))
            held = self._held[shape] = array, memoryview(np.asarray(array).reshape(-1))
        held[1][:] = Array("I", slot_ids)
        return held[0]


def slot_ids_array(slot_ids: list, shape) -> mx.array:
    """A call's slot ids, in its (..., k) order, as a uint32 array of `shape`, made from the
    host's list (a decode call's: nested where every leading dimension is 1, so that no
    reshape joins the graph). Where the host has the ids, this costs it 13-28 us a MoE layer
    less than a gather from the live table, an operation more in the graph
    (docs/benchmarks.md, session 35)."""
    if all(d == 1 for d in shape[:-1]):
        for _ in shape[:-1]:
            slot_ids = [slot_ids]
        return mx.array(slot_ids, dtype=mx.uint32)
    return mx.array(slot_ids, dtype=mx.uint32).reshape(shape)
