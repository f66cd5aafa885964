"""The store's disk side as the twin runs it: reader threads that read as macOS does
(`TwinReader`), or this machine's reader with its CPU counted (`CpuCountedReader`), into
slot rows that are never computed on (`ScratchMemory`).
"""

import threading
import time
from typing import Dict

import numpy as np

from ...format.pack import Pack, PackError, PackLayer
from ...format.records import aligned
from ...streaming.reader import Reader
from ...streaming.reads import BLOCK
from ...streaming.memory import UnorderedMemory

SLOT_MEMORY_CAP = 4.5e9  # real per-layer slot memory up to this; above, layers share rows
CRC_SLEEP_MIN_S = 0.002  # reader threads sleep their CRC32 waits in pieces of at least this


class TwinReader(Reader):
    """The real reader threads, queue, merging and preadv, reading as macOS does with
    F_NOCACHE: straight into the slot rows, one preadv per run of adjacent records (here
    with O_DIRECT, into 4 KiB aligned rows padded to the records' 16 KiB alignment, so the
    alignment gaps land in the padding), no copy out of a staging buffer. The CRC32 of each
    record is not computed here (this VM's zlib takes ~2-3 ms for 2.65 MB, a Mac's ~0.08
    ms); it is a wait of record bytes / the profile's crc32_gbps, x stretch."""

    crc_s_per_byte = 0.0
    stretch = 1.0

    def __init__(self, *args, **kwargs):
        self._local = threading.local()
        super().__init__(*args, **kwargs)

    def _read_direct(self, run, staging):
        file_index, start, _ = run[0].record.segments[0]
        end = run[-1].record.offset + run[-1].record.length
        views = []
        for i, f in enumerate(run):
            row = f.buffers[0]
            nxt = run[i + 1].record.offset if i + 1 < len(run) else None
            span = (nxt - f.record.offset) if nxt is not None else \
                -(-f.record.length // BLOCK) * BLOCK
            views.append(np.lib.stride_tricks.as_strided(row, shape=(span,), strides=(1,)))
        n = self._pread(self.direct_fds[file_index], views, start)
        if n < end - start:
            raise PackError(f"short read (expected {end - start} bytes, got {n})")
        for f in run:
            self._finish(f)
        return staging

    def _finish(self, f):
        # a short sleep overshoots (by ~1 ms on a busy VM): each thread sleeps once it owes
        # a few ms, and pays back what a sleep overran from what it owes next
        owed = getattr(self._local, "owed", 0.0) + f.record.length * self.crc_s_per_byte * self.stretch
        if owed > CRC_SLEEP_MIN_S:
            tic = self.clock()
            time.sleep(owed)
            self._verified(tic)
            owed -= self.clock() - tic
        self._local.owed = owed
        super()._finish(f)


class CpuCountedReader(Reader):
    """This machine's reader, counting its threads' CPU seconds (`time.thread_time`): the
    preadv (the kernel's O_DIRECT work), the copy out of staging, the CRC32s and the fill's
    bookkeeping. Where compute runs on this CPU (a validation here), that is what a read
    overlapping compute takes from it; `verify_s` (copy and CRC32 alone, wall time) missed
    the preadv's share, measured at 1.1 ms a decoded token of a prerouted run at 15%
    against 2.0 for the copies and CRC32s (docs/mac.md, "Validation")."""

    def __init__(self, *args, **kwargs):
        self._cpu_lock = threading.Lock()
        self._cpu_s = 0.0
        super().__init__(*args, **kwargs)

    @property
    def cpu_s(self) -> float:
        with self._cpu_lock:
            return self._cpu_s

    def _counted(self, read, *args):
        tic = time.thread_time()
        try:
            return read(*args)
        finally:
            with self._cpu_lock:
                self._cpu_s += time.thread_time() - tic

    def _read_run(self, run, staging):
        return self._counted(super()._read_run, run, staging)

    def _read_slice(self, s, staging):
        return self._counted(super()._read_slice, s, staging)


class ScratchMemory(UnorderedMemory):
    """A layer's slots as host rows the reader fills (never computed on): each row 4 KiB
    aligned and padded to the records' alignment, handed to the reader as one buffer.
    Layers may share one set of rows (`rows`), to hold large pools in less memory."""

    arrays: Dict[str, object] = {}

    def __init__(self, layer: PackLayer, num_slots: int, rows=None):
        self.nbytes = layer.expert_bytes
        self.buf = rows if rows is not None else padded_rows(num_slots, layer.expert_bytes)

    def rows(self, slot: int):
        return [self.buf[slot][:self.nbytes]]


def padded_rows(num_slots: int, nbytes: int) -> np.ndarray:
    width = aligned(nbytes)
    raw = np.zeros(num_slots * width + BLOCK, dtype=np.uint8)
    skip = (-raw.ctypes.data) % BLOCK
    return raw[skip:skip + num_slots * width].reshape(num_slots, width)


def memory_factory(pack: Pack, slots: int, cap: float = SLOT_MEMORY_CAP):
    """Per-layer rows if all layers' pools fit `cap`, else one set shared by all layers."""
    per_layer = slots * max(l.expert_bytes for l in pack.layers)
    if per_layer * len(pack.layers) <= cap:
        return (lambda layer, n: ScratchMemory(layer, n)), False
    shared = padded_rows(slots, max(l.expert_bytes for l in pack.layers))
    return (lambda layer, n: ScratchMemory(layer, n, shared)), True


def without_checksums(pack: Pack) -> Pack:
    from ...format.records import Record
    layers = [PackLayer(l.module, l.index, l.tensors, l.quantization,
                        [Record(r.segments, None) for r in l.records]) for l in pack.layers]
    return Pack(pack.path, pack.model_type, pack.top_k, layers, pack.experts_file_size,
                list(pack.files))
