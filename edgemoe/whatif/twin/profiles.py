"""Machine profiles: what a Mac (or this machine) does per byte read and per weight computed.

Profiles are data (profiles.json beside this file): every figure carries its `kind`
(measured, derived, unsourced) and its `source`. `this-machine` is measured by the tool
itself (`measure_this_machine`): O_DIRECT preads of records, `mx.quantized_matmul` at
int4 g64 (fp32 activations, as the CPU needs), and the cost of an `mx.eval` round trip.
"""

import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict

import numpy as np

PROFILES_FILE = Path(__file__).with_name("profiles.json")
CONTRIBUTED = Path(__file__).with_name("profiles")  # measured ones, a file each (README.md)
FIGURES = ("memory_gb", "ssd_read_gbps", "ssd_latency_us", "int4_gbps", "prefill_tflops",
           "host_sync_us", "sync_idle_us", "cpu_vs_here", "crc32_gbps")
KINDS = ("measured", "derived", "unsourced")


@dataclass
class Profile:
    name: str
    chip: str
    figures: Dict[str, dict]  # name -> {value, unit, kind, source}

    def value(self, figure: str) -> float:
        return float(self.figures[figure]["value"])

    @property
    def ssd_gbps(self) -> float:
        return self.value("ssd_read_gbps")

    def read_s(self, record_bytes: int, queue_depth: int = 1) -> float:
        """Time per record read at this queue depth: bytes over the bandwidth, plus the
        per-read latency shared by the reads in flight."""
        return (record_bytes / (self.ssd_gbps * 1e9)
                + self.value("ssd_latency_us") * 1e-6 / max(queue_depth, 1))

    def span(self, figure: str):
        """(low, high) of a figure: its cited `range`, or its value twice."""
        f = self.figures[figure]
        low, high = f.get("range", (f["value"], f["value"]))
        return float(low), float(high)

    def with_value(self, figure: str, value: float) -> "Profile":
        """This profile with one figure replaced (the back-test's sensitivity)."""
        figures = dict(self.figures)
        figures[figure] = dict(figures[figure], value=value)
        return Profile(self.name, self.chip, figures)

    def unsourced(self):
        return [k for k, f in self.figures.items() if f.get("kind") == "unsourced"]

    def to_json(self) -> dict:
        return {"name": self.name, "chip": self.chip, "figures": self.figures}


def check_profile(name: str, d: dict) -> Profile:
    figures = {k: v for k, v in d.items() if isinstance(v, dict)}
    for k in FIGURES:
        if k not in figures:
            raise ValueError(f"profile {name}: figure {k} missing")
    for k, f in figures.items():
        if "value" not in f or not f.get("source") or f.get("kind") not in KINDS:
            raise ValueError(f"profile {name}: figure {k} needs a value, a kind "
                             f"({', '.join(KINDS)}) and a source (found {f})")
    return Profile(name, d.get("chip", name), figures)


def all_profiles(path: Path = PROFILES_FILE, contributed: Path = CONTRIBUTED) -> Dict[str, Profile]:
    """profiles.json's, and each measured profile contributed under profiles/ (named by
    its file: `m4-pro-24gb-measured.json` is `m4-pro-24gb-measured`)."""
    data = json.loads(Path(path).read_text())
    found = {k: check_profile(k, v) for k, v in data.items() if not k.startswith("_")}
    for f in sorted(Path(contributed).glob("*.json")) if Path(contributed).is_dir() else []:
        d = json.loads(f.read_text())
        if f.stem in found:
            raise ValueError(f"{f}: a profile named {f.stem} is already in {path}")
        found[f.stem] = check_profile(f.stem, d.get("figures", d))
    return found


def load_profile(name_or_path: str) -> Profile:
    """A named profile of profiles.json, or a .json file (e.g. `this-machine`'s, written by
    `measure_this_machine`)."""
    p = Path(name_or_path)
    if p.suffix == ".json" and p.exists():
        d = json.loads(p.read_text())
        return check_profile(d.get("name", p.stem), d.get("figures", d))
    profiles = all_profiles()
    if name_or_path not in profiles:
        raise ValueError(f"profile {name_or_path!r}: choose from {', '.join(profiles)}, or "
                         f"a profile .json (python scripts/bench_twin.py --measure OUT.json)")
    return profiles[name_or_path]


# -- this machine, measured --

def _aligned(n: int) -> np.ndarray:
    raw = np.empty(n + 4096, dtype=np.uint8)
    skip = (-raw.ctypes.data) % 4096
    return raw[skip:skip + n]


def measure_reads(path: Path, record_bytes: int, reads: int = 64, threads: int = 2,
                  seed: int = 0, direct: bool = True) -> dict:
    """Random reads of `record_bytes` (4 KiB aligned offsets) from `path` by `threads`
    threads: seconds per record (wall / reads) and GB/s."""
    size = os.path.getsize(path)
    length = (record_bytes + 4095) // 4096 * 4096
    if size < length:
        raise ValueError(f"{path}: {size} bytes, shorter than one read of {length}")
    rng = np.random.default_rng(seed)
    offsets = (rng.integers(0, (size - length) // 4096 + 1, reads) * 4096).tolist()
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    fd = os.open(path, flags)
    if direct and not hasattr(os, "O_DIRECT"):  # macOS: F_NOCACHE, as the store reads
        import fcntl
        fcntl.fcntl(fd, getattr(fcntl, "F_NOCACHE", 48), 1)
    lock = threading.Lock()

    def work():
        buf = _aligned(length)
        while True:
            with lock:
                if not offsets:
                    return
                off = offsets.pop()
            os.preadv(fd, [buf], off)

    tic = time.perf_counter()
    ts = [threading.Thread(target=work) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - tic
    os.close(fd)
    return {"record_bytes": record_bytes, "threads": threads, "reads": reads,
            "s_per_record": wall / reads, "gbps": reads * record_bytes / wall / 1e9}


def measure_compute(d: int = 2048, f: int = 768, repeats: int = 20) -> dict:
    """int4 g64 `mx.quantized_matmul` on this machine's default device, fp32 activations:
    GB/s of weights at one token (decode) and TFLOP/s at 256 tokens (prefill); the cost of
    one `mx.eval` round trip on a tiny graph."""
    import mlx.core as mx

    w = mx.random.normal((f, d))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    nbytes = wq.nbytes + scales.nbytes // 2 + biases.nbytes // 2  # as bf16 scales on disk

    def timed(x, n):
        y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
        mx.eval(y)
        tic = time.perf_counter()
        for _ in range(n):
            y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64,
                                    bits=4)
            mx.eval(y)
        return (time.perf_counter() - tic) / n

    one = timed(mx.random.normal((1, d)), repeats)
    many = timed(mx.random.normal((256, d)), max(2, repeats // 5))
    import zlib
    block = np.random.default_rng(0).bytes(8 * 2**20)
    tic = time.perf_counter()
    for _ in range(5):
        zlib.crc32(block)
    crc = len(block) * 5 / (time.perf_counter() - tic) / 1e9
    sync, idle = measure_sync(wq, scales, biases, d, max(4, 2 * repeats))
    return {"int4_gbps": nbytes / one / 1e9, "prefill_tflops": 2 * d * f * 256 / many / 1e12,
            "host_sync_us": sync * 1e6, "sync_idle_us": idle * 1e6, "crc32_gbps": crc,
            "shape": [f, d]}


LAYER_OPS = 40  # ops a MoE layer's decode graph builds (norms, attention, router, experts)


def _layer_graph(x, wq, scales, biases):
    """A decode layer's worth of small ops on `x` (1, d), built lazily."""
    import mlx.core as mx
    for _ in range(LAYER_OPS // 4):
        y = mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=64, bits=4)
        x = x + mx.sum(y) * 1e-6
        x = x * mx.rsqrt(mx.mean(x * x) + 1e-6)
    return x


def measure_sync(wq, scales, biases, d: int, repeats: int = 40) -> tuple:
    """(read-back s, idle s) on the default device, medians: the round trip of reading a
    result back (a one-element graph queued, then read: the read itself, BigRig's 0.2-0.35
    ms on an M4; the work queued before a read is compute, which the twin counts apart:
    host_sync_us), and the host's time to build a layer's graph, which the device waits for
    after a read (sync_idle_us). This once took a read after a layer's work less that work
    pipelined: two numbers of ~17 ms on this VM's CPU whose difference read 26 us, 443 us
    and 2.07 ms in three sessions (docs/mac.md, "Held-out validation"); the direct read
    here reads 32-33 us at a load of 7."""
    import mlx.core as mx
    y = mx.zeros((1,))
    mx.eval(y)
    reads = []
    for _ in range(5 * max(repeats, 20)):
        y = y + 1
        tic = time.perf_counter()
        y.item()
        reads.append(time.perf_counter() - tic)
    x = mx.random.normal((1, d))
    builds = []
    for _ in range(repeats):
        tic = time.perf_counter()
        x = _layer_graph(x, wq, scales, biases)
        builds.append(time.perf_counter() - tic)
        mx.eval(x)
    return float(np.median(reads)), float(np.median(builds))


def measured(how: str):
    """`fig(value, unit, what)`: a figure measured here, its source `how` and `what`."""

    def fig(value, unit: str, what: str) -> dict:
        return {"value": round(float(value), 4), "unit": unit, "kind": "measured",
                "source": f"{how}: {what}"}

    return fig


def machine_figures(fig, c: dict, ssd_read_gbps: dict, ssd_latency_us: dict,
                    cpu_vs_here: dict, int4: str, sync_idle: str) -> Dict[str, dict]:
    """A measured profile's figures, in their order: the disk's and the Python's as measured
    (`ssd_read_gbps`, `ssd_latency_us`, `cpu_vs_here`), and the rest from here: physical
    memory and measure_compute's `c`, made by `fig` (`measured`); `int4` and `sync_idle`
    say how those two were measured."""
    return {
        "memory_gb": fig(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, "GB",
                         "physical memory"),
        "ssd_read_gbps": ssd_read_gbps,
        "ssd_latency_us": ssd_latency_us,
        "int4_gbps": fig(c["int4_gbps"], "GB/s", f"{int4}, one token, {c['shape']}"),
        "prefill_tflops": fig(c["prefill_tflops"], "TFLOP/s", "same, 256 tokens"),
        "host_sync_us": fig(c["host_sync_us"], "us", "a read-back of a one-element graph, "
                                                     "median (the read itself)"),
        "sync_idle_us": fig(c["sync_idle_us"], "us", sync_idle),
        "cpu_vs_here": cpu_vs_here,
        "crc32_gbps": fig(c["crc32_gbps"], "GB/s", "zlib.crc32 of 8 MiB, this Python"),
    }


def measure_this_machine(read_file: Path, record_bytes: int = 2654208, threads: int = 2) -> Profile:
    """A profile of this machine: disk (at `record_bytes` and 256 KiB, for bandwidth and
    latency), CPU int4 compute and host sync, each marked measured with how and when."""
    big = measure_reads(read_file, record_bytes, 48, threads)
    small = measure_reads(read_file, 256 * 1024, 96, threads)
    # s = lat/QD + bytes/bw at both sizes
    slope = (big["s_per_record"] - small["s_per_record"]) / (record_bytes - 256 * 1024)
    bw = 1 / slope / 1e9 if slope > 0 else big["gbps"]
    lat = max(0.0, (small["s_per_record"] - 256 * 1024 * slope) * threads)
    c = measure_compute()
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    how = f"edgemoe.whatif.twin.profiles.measure_this_machine on {os.uname().nodename}, {when}"
    fig = measured(how)
    figures = machine_figures(
        fig, c, ssd_read_gbps=fig(bw, "GB/s", f"O_DIRECT random reads of {record_bytes} and "
                                              f"262144 bytes, {threads} threads, of {read_file}"),
        ssd_latency_us=fig(lat * 1e6, "us", "intercept of the same two sizes"),
        cpu_vs_here=fig(1.0, "x", "this machine"), int4="mx.quantized_matmul int4 g64 fp32",
        sync_idle="Python building a layer-like graph (40 ops; the device waits for it after "
                  "a read), median")
    p = Profile("this-machine", f"this machine ({os.cpu_count()} CPUs)", figures)
    p.figures["_reads"] = {"value": 0, "kind": "measured", "source": how,
                           "detail": [big, small]}
    return p
