"""The background reader: a few threads that fill expert slots (their reads:
edgemoe.streaming.reads).

Fills of one layer are submitted together; records adjacent in the file are merged into
one read. An expert read in place is several tensor slices, each queued on its own so that
the threads keep as many reads in flight as for a pack (a slice of 100-800 KB is one
request to the disk, where a 3 MB record is several). A fill whose read has not begun can
be cancelled.
"""

import os
import queue
import threading
from typing import List

from ..format.pack import ALIGNMENT, Pack
from .reads import Fill, PackReads, Slice, report

# A merged read spans at most this much (one record may be longer): larger reads gain no
# bandwidth, and an O_DIRECT staging buffer grows to the longest read of its thread (a
# prefill needing most experts would otherwise merge a whole pass into one read).
MAX_RUN_BYTES = 8 * 2**20
# ... and fills at most this many buffers: preadv fails with EINVAL beyond IOV_MAX (1024 on
# Linux and macOS), which a full layer of fine-grained experts (128 records of 9 tensors,
# each with an alignment gap) reaches within MAX_RUN_BYTES.
MAX_RUN_BUFFERS = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


class Cancelled(Exception):
    """A fill's end when it was cancelled before its read began."""


CANCELLED = Cancelled("cancelled before its read began")


class Reader(PackReads):
    """Reader threads over a pack's files, taking fills from one queue."""

    def __init__(self, pack: Pack, threads: int = 2, io: str = "buffered"):
        super().__init__(pack, io)
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()  # (C: no Python to put)
        self.threads = [threading.Thread(target=self._run, daemon=True, name=f"edgemoe-reader-{i}")
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def submit(self, fills: List[Fill]):
        """Queue one layer's fills, merging records that lie back to back; a record in
        place goes as its slices."""
        if len(fills) == 1 and len(fills[0].record.segments) == 1:
            self.queue.put(fills)  # (a decode call's one miss)
            return
        # (by file and offset; a record's segments read directly, not through its
        # properties: a long prefill's layer submits a hundred fills)
        fills = sorted(fills, key=lambda f: f.record.segments[0][:2])
        run: List[Fill] = []
        buffers = 0  # of the run's preadv: each record's, and the gap after it
        run_file = start = end = 0  # the run's file, first offset, and its last record's end
        for f in fills:
            segments = f.record.segments
            if len(segments) > 1:
                f.pending, f.ready = len(segments), threading.Event()
                for i in range(f.pending):  # slice 0 first: it runs before_read
                    self.queue.put(Slice(f, i))
                continue
            file, offset, length = segments[0]
            if run and (file != run_file or not 0 <= offset - end < ALIGNMENT  # (_adjacent)
                        or offset + length - start > MAX_RUN_BYTES
                        or buffers + len(f.buffers) > MAX_RUN_BUFFERS):
                self.queue.put(run)
                run, buffers = [], 0
            if not run:
                run_file, start = file, offset
            run.append(f)
            end = offset + length
            buffers += len(f.buffers) + 1
        if run:
            self.queue.put(run)

    def cancel(self, fill: Fill) -> bool:
        """Cancel `fill` if its read has not begun (a record of a pack; the slices of a
        record read in place are not cancelled): True if it will end unread."""
        with self.lock:
            if fill.begun or fill.ready is not None:
                return False
            fill.cancelled = True
            return True

    def _begin(self, run: List[Fill]) -> List[List[Fill]]:
        """The fills of `run` still wanted, marked begun (none can be cancelled from now),
        as runs of adjacent records; the cancelled ones end, unread."""
        with self.lock:
            live = [f for f in run if not f.cancelled]
            for f in live:
                f.begun = True
        for f in run:
            if f.cancelled:
                report(f, 0, CANCELLED)
        if len(live) == len(run):
            return [run] if run else []
        runs: List[List[Fill]] = []
        for f in live:  # a cancelled record may have joined two: read them apart
            if runs and _adjacent(runs[-1][-1].record, f.record):
                runs[-1].append(f)
            else:
                runs.append([f])
        return runs

    def alive(self) -> bool:
        return all(t.is_alive() for t in self.threads)

    def close(self):
        for _ in self.threads:
            self.queue.put(None)
        for t in self.threads:
            # (a store whose last reference a fill's end dropped closes on its own reader
            # thread, which then ends at its stop mark: it cannot join itself)
            if t is not threading.current_thread():
                t.join(timeout=5)
        super().close()

    def _run(self):
        staging = None
        while True:
            run = self.queue.get()
            if run is None:
                return
            if isinstance(run, Slice):
                staging = self._read_slice(run, staging)
                continue
            for part in self._begin(run):
                staging = self._read_run(part, staging)


def _adjacent(a, b) -> bool:
    if len(a.segments) != 1 or len(b.segments) != 1 or a.segments[0][0] != b.segments[0][0]:
        return False
    end = a.offset + a.length
    return b.offset >= end and b.offset - end < ALIGNMENT
