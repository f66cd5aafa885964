"""A fill, and the reads that land it: bytes by `preadv` from a pack's files into the
fill's buffers, checked against the record's CRC32, timed.

`os.preadv` releases the GIL, so reads proceed while MLX computes on the main thread.
With O_DIRECT the page cache is bypassed: a read of the 4 KiB-aligned span around a
record (or, in place, around each tensor slice) lands in an aligned staging buffer and is
copied into the slots (whose rows are not 4 KiB aligned); a filesystem that refuses
O_DIRECT falls back to buffered reads followed by `posix_fadvise(DONTNEED)`. macOS has no
O_DIRECT: there `F_NOCACHE` on the file descriptors keeps the reads out of the unified
buffer cache instead. PackReads is the Reader's (edgemoe.streaming.reader) reading half;
its threads and queue are the other.
"""

import errno
import fcntl
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional

import numpy as np

from ..format.pack import ALIGNMENT, Pack, PackError

BLOCK = 4096  # O_DIRECT alignment of buffers, offsets and lengths
F_NOCACHE = getattr(fcntl, "F_NOCACHE", 48)  # macOS's fcntl command (Python < 3.13 lacks it)


@dataclass(slots=True)  # (made for every miss: slots make it cheaper to make and read)
class Fill:
    """One expert being read into one slot. `done` (None: not kept) is set on success and
    on error, by `on_done`; `ended`, the same without allocating an Event per fill, is
    for `on_done` to set too (edgemoe.streaming.fills), and to release `latch` (a lock
    held while the fill is in flight, that a waiter blocks on: one C call, where an Event
    or a Condition costs Python on both sides); `reported` once the reader has called
    `on_done`.

    `before_read(slot)`, if given, runs on the reader thread before `buffers` are
    written: a device backend waits there until a buffer's previous copy has finished.
    """

    layer_index: int
    expert: int
    slot: int
    record: object
    buffers: List[np.ndarray]
    on_done: Callable[["Fill", int, Optional[Exception]], None]
    done: Optional[threading.Event] = field(default_factory=threading.Event)
    error: Optional[Exception] = None
    ended: bool = False
    latch: Optional[Any] = None
    reported: bool = False
    before_read: Optional[Callable[[int], None]] = None
    # a record of several segments (in place; or with deltas): the slices still to land,
    # the first failure, set once before_read has run
    pending: int = 0
    failed: Optional[Exception] = None
    ready: Optional[threading.Event] = None
    # a fill the reader has not begun can be cancelled (`Reader.cancel`); it then ends
    # with CANCELLED (edgemoe.streaming.reader) as its error, unread
    begun: bool = False
    cancelled: bool = False


@dataclass
class Slice:
    """Tensor slice `index` of a fill read in place; the last of its fill to land
    finishes the fill."""

    fill: Fill
    index: int


class PackReads:
    """A pack's files opened for reading, and the reads of fills from them. `busy_s` is
    the wall time with at least one `preadv` in flight (an interval still open counts up
    to now), so bytes over it is the disk's bandwidth while reading; `verify_s` is the time
    spent checking CRC32s and copying out of the O_DIRECT staging buffer, summed over
    threads. `clock` can be replaced (tests)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, pack: Pack, io: str = "buffered"):
        if io not in ("buffered", "direct"):
            raise ValueError(f"io {io!r}: choose buffered or direct")
        self.pack = pack
        self.fds = [os.open(f, os.O_RDONLY) for f in pack.files]
        self.direct_fds: List[int] = []  # per file, with O_DIRECT
        self.nocache = False  # macOS: F_NOCACHE set on self.fds
        self.drop_cache = False
        if io == "direct":
            self._open_direct()
        self.lock = threading.Lock()
        self.busy = 0  # reads in flight
        self.busy_since = 0.0
        self._busy_s = 0.0  # closed intervals with at least one read in flight
        self._verify_s = 0.0
        self._in_flight = {}  # thread id -> when its preadv started

    def _open_direct(self):
        if sys.platform == "darwin":
            for fd in self.fds:
                fcntl.fcntl(fd, F_NOCACHE, 1)
            self.nocache = True
            return
        if not hasattr(os, "O_DIRECT"):
            reason = "no O_DIRECT here"
        else:
            try:
                for f in self.pack.files:
                    self.direct_fds.append(os.open(f, os.O_RDONLY | os.O_DIRECT))
                return
            except OSError as e:
                reason = f"{f}: {os.strerror(e.errno)}"
                for fd in self.direct_fds:
                    os.close(fd)
                self.direct_fds = []
        self.drop_cache = True
        print(f"[edgemoe] O_DIRECT unavailable ({reason}); buffered reads with "
              f"posix_fadvise(DONTNEED)", file=sys.stderr)

    @property
    def io(self) -> str:
        if self.direct_fds or self.nocache:
            return "direct"
        return "buffered+dontneed" if self.drop_cache else "buffered"

    def close(self):
        for fd in self.fds + self.direct_fds:
            os.close(fd)
        self.fds, self.direct_fds = [], []

    def _read_run(self, run: List[Fill], staging):
        try:
            for f in run:
                if f.before_read is not None:
                    f.before_read(f.slot)
            if self.direct_fds:
                staging = self._read_direct(run, staging)
            else:
                self._read_buffered(run)
        except Exception as e:  # every fill of the run fails with a clear error
            for f in run:
                if not f.reported:
                    report(f, 0, _describe(self.pack, f, e))
        return staging

    def _read_buffered(self, run: List[Fill]):
        """A run of pack records: one read of their span, the alignment gaps between
        them read into scratch."""
        file_index, offset, _ = run[0].record.segments[0]
        buffers = []
        for i, f in enumerate(run):
            buffers += f.buffers
            if i + 1 < len(run):  # the alignment gap between two records
                gap = run[i + 1].record.offset - (f.record.offset + f.record.length)
                if gap:
                    buffers.append(bytearray(gap))
        total = sum(memoryview(b).nbytes for b in buffers)
        n = self._pread(self.fds[file_index], buffers, offset)
        if n != total:
            raise PackError(f"short read (expected {total} bytes, got {n}); "
                            f"the file is truncated")
        if self.drop_cache:
            os.posix_fadvise(self.fds[file_index], offset, total, os.POSIX_FADV_DONTNEED)
        for f in run:
            self._finish(f)

    def _read_direct(self, run: List[Fill], staging):
        """A run of pack records: one read of their span, copied out of staging."""
        file_index, start, _ = run[0].record.segments[0]
        end = run[-1].record.offset + run[-1].record.length
        staging, base = self._read_span(file_index, start, end, staging)
        for f in run:
            self._copy_out(staging, base + f.record.offset - start, f.buffers)
            self._finish(f)
        return staging

    def _read_slice(self, s: Slice, staging):
        """One segment of a record: a tensor slice in place, or an expert's delta (with
        O_DIRECT, its aligned span)."""
        f = s.fill
        file_index, offset, length = f.record.segments[s.index]
        try:
            bufs = _segment_buffers(f, s.index)
            if s.index == 0:
                if f.before_read is not None:
                    f.before_read(f.slot)
                f.ready.set()
            else:
                f.ready.wait()
            if f.failed is None:
                if self.direct_fds:
                    staging, at = self._read_span(file_index, offset, offset + length,
                                                  staging)
                    self._copy_out(staging, at, bufs)
                else:
                    n = self._pread(self.fds[file_index], bufs, offset)
                    if n != length:
                        raise PackError(f"short read (expected {length} bytes, got {n}); "
                                        f"the file is truncated")
                    if self.drop_cache:
                        os.posix_fadvise(self.fds[file_index], offset, length,
                                         os.POSIX_FADV_DONTNEED)
        except Exception as e:
            f.ready.set()  # the other slices stop waiting, and skip their reads
            with self.lock:
                f.failed = f.failed or _describe(self.pack, f, e)
        with self.lock:
            f.pending -= 1
            last = f.pending == 0
        if last:
            if f.failed is not None:
                report(f, 0, f.failed)
            else:
                self._finish(f)
        return staging

    def _read_span(self, file_index: int, start: int, end: int, staging):
        """Read [start, end) with O_DIRECT, widened to 4 KiB blocks, into `staging` (grown
        when short): (staging, where `start` lies in it)."""
        lo = start // BLOCK * BLOCK
        length = (end - lo + BLOCK - 1) // BLOCK * BLOCK
        if staging is None or len(staging) < length:
            staging = _aligned_buffer(max(length, ALIGNMENT))
        n = self._pread(self.direct_fds[file_index], [staging[:length]], lo)
        if n < end - lo:
            raise PackError(f"short read (expected {end - lo} bytes, got {n}); "
                            f"the file is truncated")
        return staging, start - lo

    def _copy_out(self, staging, at: int, buffers):
        tic = self.clock()
        for buf in buffers:
            flat = buf.reshape(-1).view(np.uint8)
            flat[:] = staging[at:at + flat.nbytes]
            at += flat.nbytes
        self._verified(tic)

    def _finish(self, f: Fill):
        crc = f.record.crc32
        if crc is not None:
            tic = self.clock()
            found = 0
            for b in f.buffers:
                found = zlib.crc32(b, found)
            self._verified(tic)
            if found != crc:
                report(f, 0, PackError(
                    f"{self.pack.files[f.record.segments[0][0]]}: layer {f.layer_index} "
                    f"expert {f.expert}: "
                    f"checksum mismatch (expected {crc:08x}, found {found:08x})"))
                return
        report(f, f.record.length, None)

    @property
    def busy_s(self) -> float:
        with self.lock:
            open_s = self.clock() - self.busy_since if self.busy else 0.0
            return self._busy_s + open_s

    def oldest_read_s(self) -> float:
        """How long the oldest read still in flight has taken (0 with none)."""
        with self.lock:
            return self.clock() - min(self._in_flight.values()) if self._in_flight else 0.0

    @property
    def verify_s(self) -> float:
        with self.lock:
            return self._verify_s

    def _pread(self, fd: int, buffers, offset: int) -> int:
        """`os.preadv`, timed: only the read itself counts as busy."""
        with self.lock:
            now = self.clock()
            if self.busy == 0:
                self.busy_since = now
            elif now > self.busy_since:  # close the part before now, so snapshots split it
                self._busy_s += now - self.busy_since
                self.busy_since = now
            self.busy += 1
            self._in_flight[threading.get_ident()] = now
        try:
            return os.preadv(fd, buffers, offset)
        finally:
            with self.lock:
                self._in_flight.pop(threading.get_ident(), None)
                now = self.clock()
                self._busy_s += now - self.busy_since
                self.busy_since = now
                self.busy -= 1

    def _verified(self, since: float):
        with self.lock:
            self._verify_s += self.clock() - since


def report(f: Fill, nbytes: int, error: Optional[Exception]):
    """The fill has ended: tell its `on_done`."""
    f.reported = True
    f.on_done(f, nbytes, error)


def _segment_buffers(f: Fill, index: int) -> List[np.ndarray]:
    """The buffers segment `index` of a fill's record fills: segments cover the buffers
    in order, back to back (in place one tensor each; an expert and its delta, several)."""
    start = sum(length for _, _, length in f.record.segments[:index])
    length = f.record.segments[index][2]
    part, at = [], 0
    for buf in f.buffers:
        if start <= at < start + length:
            part.append(buf)
        at += buf.nbytes
    if sum(b.nbytes for b in part) != length:
        raise PackError(f"a record segment of {length} bytes does not end at a tensor's end")
    return part


def _aligned_buffer(n: int) -> np.ndarray:
    raw = np.empty(n + BLOCK, dtype=np.uint8)
    skip = (-raw.ctypes.data) % BLOCK
    return raw[skip:skip + n]


def _describe(pack: Pack, f: Fill, e: Exception) -> PackError:
    where = f"{pack.files[f.record.segments[0][0]]}: layer {f.layer_index} expert {f.expert}"
    if isinstance(e, OSError):
        return PackError(f"{where}: read failed ({os.strerror(e.errno or errno.EIO)})")
    return PackError(f"{where}: {e}")
