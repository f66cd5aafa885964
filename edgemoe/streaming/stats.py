"""The store's counters and the one definition of a hit.

Each call of a MoE layer *requests* its distinct experts (the union over the batch's
tokens). A request is a **hit** when the expert is ready in a slot, **late** when it is
already being read (a prefetch that had not landed: compute waits), and **on demand**
when nothing had started reading it. A backend with a host-memory tier between the disk
and its slots (edgemoe.cuda) serves some loads from RAM: **host hits**, a copy and no read. The hit rate is hits over requests. Fills
started ahead of need are **prefetches**; every fill is a **load** (on demand or
prefetched), so a prefetch later used counts once as a load and once as a hit.
"""

from dataclasses import dataclass, fields


@dataclass
class ExpertStats:
    """Counters of one store; subtract two snapshots for the stats of a span."""

    hits: int = 0  # a requested expert was ready
    late_fills: int = 0  # a requested expert was still being read
    on_demand: int = 0  # a requested expert was read only when asked for
    loads: int = 0  # fills started (on demand or prefetched)
    host_hits: int = 0  # ... of which a host-memory tier held: a copy, not a read (CUDA)
    prefetches: int = 0  # fills started ahead of need
    evictions: int = 0
    bytes_read: int = 0  # bytes of finished fills
    bytes_used: int = 0  # bytes of requested experts: what compute read from slots
    bytes_hit: int = 0  # ... of which were already in memory
    blocked_s: float = 0.0  # compute waited this long for fills
    predicted: int = 0  # experts predicted for layer calls that then ran
    predicted_used: int = 0  # ... of which the call requested
    needed: int = 0  # experts requested by calls that had a prediction
    prefetch_wasted_bytes: int = 0  # prefetched, then evicted before any call requested it
    prefetch_evicted_needed: int = 0  # requests of experts a prefetch had evicted
    prefetch_cancelled: int = 0  # prefetches dropped unread: the call they were for ran
    #                              without them (stale), and the reader had not begun them
    read_busy_s: float = 0.0  # wall time with a preadv in flight
    verify_s: float = 0.0  # CRC32 checks and O_DIRECT staging copies, summed over threads
    host_syncs: int = 0  # evaluations the expert path waited on (routing, each pass's compute)

    @property
    def requests(self) -> int:
        return self.hits + self.late_fills + self.on_demand

    @property
    def hit_rate(self) -> float:
        return self.hits / self.requests if self.requests else 1.0

    @property
    def precision(self) -> float:
        return self.predicted_used / self.predicted if self.predicted else 0.0

    @property
    def recall(self) -> float:
        return self.predicted_used / self.needed if self.needed else 0.0

    @property
    def read_gbps(self) -> float:
        """The disk's bandwidth while reading: bytes over the time a preadv was in flight
        (checksums and copies are not in it: see verify_s)."""
        return self.bytes_read / self.read_busy_s / 1e9 if self.read_busy_s else 0.0

    def __sub__(self, other: "ExpertStats") -> "ExpertStats":
        return ExpertStats(*(getattr(self, f.name) - getattr(other, f.name)
                             for f in fields(self)))

    def copy(self) -> "ExpertStats":
        return ExpertStats(*(getattr(self, f.name) for f in fields(self)))

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d.update(requests=self.requests, hit_rate=self.hit_rate, read_gbps=self.read_gbps)
        return d
