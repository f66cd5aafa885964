"""A machine profile any user can measure and share: `python -m edgemoe.doctor
--measure-machine OUT.json`, then `doctor --machine OUT.json --model SHAPE` forecasts from it.

What it measures, each figure marked measured with how and when (docs/mac.md, "Your Mac's
profile"):

    SSD          random reads of a scratch file it writes (or --read-file), bypassing the
                 page cache (O_DIRECT on Linux, F_NOCACHE on macOS), per record size and
                 queue depth (reader threads): the table, and from it the bandwidth and the
                 per-read latency the twin uses
    int4         `mx.quantized_matmul` int4 g64 on the default device, one token and 256
    host sync    the read-back of a result (a one-element graph: the read itself), and the
                 host's time to build a layer's graph (the device waits for it)
    our Python   the store's own bookkeeping (a replay of a bundled trace through
                 edgemoe.whatif.replay), timed against the project's VM: cpu_vs_here
"""

import os
import platform
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from .profiles import Profile, machine_figures, measure_compute, measure_reads, measured

RECORD_SIZES = (256 * 1024, 1024 * 1024, 4 * 1024 * 1024)
QUEUE_DEPTHS = (1, 2, 4, 8)
# seconds this replay took on the project's dev VM (Linux x86_64, 2 shared cores; median of
# 5, best of 3, 2026-12-04, under a load of ~12: a quiet VM is faster, so a cpu_vs_here
# measured against it reads up to ~2x high): cpu_vs_here = this / the machine's own
REFERENCE_PYTHON_S = 0.44
TRACE = Path(__file__).resolve().parents[2] / "models" / "fine" / "traces" / "stdlib.npz"


def python_seconds(repeats: int = 5, decode: int = 64) -> float:
    """Median seconds of the store's Python: a replay of a bundled trace's prompt and first
    `decode` decoded tokens at 25%."""
    from ..replay import simulate, trace_calls
    from ...streaming.trace import load_trace
    trace = load_trace(TRACE)
    calls = trace_calls(trace)
    decoded = np.cumsum([bool(trace["decode"][c.start]) for c in calls])
    kept = calls[:int(np.searchsorted(decoded, decode, side="right"))]
    end = kept[-1].stop
    short = {k: v for k, v in trace.items() if not k.startswith("prefetch")}
    short.update(routed=trace["routed"][:end], decode=trace["decode"][:end],
                 calls=np.array([c.stop - c.start for c in kept], dtype=np.int32))
    times = []
    for _ in range(repeats):
        tic = time.perf_counter()
        simulate(short, "25%", "lfu")
        times.append(time.perf_counter() - tic)
    return float(np.median(times))


def scratch_file(folder: Path, megabytes: int) -> Path:
    """A file of random bytes to read back (written once, synced to the disk)."""
    path = Path(folder) / ".edgemoe-measure.bin"
    block = np.random.default_rng(0).bytes(8 * 2**20)
    with open(path, "wb") as f:
        for _ in range(max(1, megabytes // 8)):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    return path


def ssd_table(path: Path, sizes: Sequence[int], depths: Sequence[int], reads: int) -> list:
    """GB/s per record size and queue depth, past the page cache (a file system that
    refuses O_DIRECT, tmpfs, is read buffered, and each row says so)."""
    rows = []
    for size in sizes:
        for qd in depths:
            n = max(qd * 2, min(reads, os.path.getsize(path) // size))
            try:
                row = measure_reads(path, size, n, qd, seed=size + qd, direct=True)
            except OSError:
                row = dict(measure_reads(path, size, n, qd, seed=size + qd, direct=False),
                           buffered=True)
            rows.append(row)
    return rows


def fit_ssd(rows: list) -> tuple:
    """(GB/s, latency s) from the table: the best bandwidth at the largest record, and the
    intercept of seconds per read against size at queue depth 1."""
    big = max(r["record_bytes"] for r in rows)
    gbps = max(r["gbps"] for r in rows if r["record_bytes"] == big)
    qd1 = sorted((r for r in rows if r["threads"] == 1), key=lambda r: r["record_bytes"])
    if len(qd1) >= 2:
        x = np.array([r["record_bytes"] for r in qd1], dtype=float)
        y = np.array([r["s_per_record"] for r in qd1])
        slope, intercept = np.polyfit(x, y, 1)
        latency = max(float(intercept), 0.0)
    else:
        latency = 0.0
    return gbps, latency


def measure_machine(out: Path, read_file: Optional[Path] = None, megabytes: int = 1024,
                    sizes: Sequence[int] = RECORD_SIZES, depths: Sequence[int] = QUEUE_DEPTHS,
                    reads: int = 64, name: Optional[str] = None, repeats: int = 5) -> Profile:
    """Measure this machine and write its profile to `out` (a .json that `doctor --machine`
    and `bench_twin.py --profile` take)."""
    out = Path(out)
    made = read_file is None
    path = scratch_file(out.parent, megabytes) if made else Path(read_file)
    try:
        table = ssd_table(path, sizes, depths, reads)
    finally:
        if made:
            path.unlink(missing_ok=True)
    gbps, latency = fit_ssd(table)
    c = measure_compute(repeats=4 * repeats)
    py = python_seconds(repeats)
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = (f"python -m edgemoe.doctor --measure-machine on {platform.platform()}, "
           f"Python {sys.version.split()[0]}, {when}")

    fig = measured(how)
    figures = machine_figures(
        fig, c, ssd_read_gbps=fig(gbps, "GB/s", f"best of random reads of {max(sizes)} bytes "
                                                f"at queue depths {list(depths)}"),
        ssd_latency_us=fig(latency * 1e6, "us", "intercept of seconds per read against "
                                                "record size, queue depth 1"),
        cpu_vs_here=fig(REFERENCE_PYTHON_S / py, "x", f"the store's Python (a replay) "
                                                      f"{py:.3f} s here, {REFERENCE_PYTHON_S} "
                                                      f"s on the project's VM"),
        int4="mx.quantized_matmul int4 g64",
        sync_idle="the host building a layer-like graph, median")
    profile = Profile(name or f"measured-{platform.node() or 'machine'}",
                      f"{platform.machine()} {platform.processor() or ''}".strip() +
                      f", {os.cpu_count()} CPUs", figures)
    doc = dict(profile.to_json(), ssd_table=table, how=how)
    import json
    tmp = out.with_suffix(out.suffix + ".part")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)  # nothing half-written
    return profile
