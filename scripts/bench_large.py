"""A model larger than the memory it is given, end to end: make it, convert it, decode it.

    sudo python scripts/bench_large.py --checkpoint DIR --pack DIR [--gguf FILE] [--make 28GB]
           [--experts 512] [--memory 8G] [--budgets 0.05,0.1] [--io direct,buffered]
           [--sources pack,inplace] [--arithmetic native,blas] [--prompt-tokens 64] [--max-tokens 9]
           [--json out.json] [--png out.png]

With --make SIZE and no checkpoint at DIR, scripts/make_large_checkpoint.py writes a
synthetic Qwen3-30B-A3B-shaped mlx-lm int4 checkpoint of that size (--experts per layer);
with no pack at --pack, `edgemoe.convert` packs it; with --gguf and no file there,
scripts/mlx_to_gguf.py writes the same model as llama.cpp reads it (when the disk cannot
hold all three, the pack this run made is removed once its rows are done). Everything runs
under `edgemoe.constrained --memory` (a memory cgroup that counts the page cache),
each configuration in its own process with the page cache dropped first:

  edgemoe    from the pack and in place (--sources), at each budget, with each --io
  llama.cpp  llama-cpp-python on the GGUF: experts paged in through mmap (pip install
             -e '.[peers]')
  mlx-lm     mlx_lm.load + generate_step on the checkpoint (it must hold everything)
  runtime    Python with edgemoe, mlx-lm and the tokenizer loaded, no model: what the
             cgroup counts for the runtime alone (its libraries' page cache included)

Per configuration: whether it ran or was killed (exit 137), time to first token on a
--prompt-tokens prompt, decode tok/s, peak memory (the cgroup's: RSS + page cache) and peak
RSS, GB read from disk per decoded token (/proc/self/io), read GB/s while reading, ms
blocked per token; and, run just before each edgemoe configuration, `fio` on the same files
at the same read sizes (O_DIRECT random reads, 2 jobs: a pack's records, or in place the
tensor slices of an expert in their mix), when fio is installed (Debian: apt-get install
fio). One round per configuration: at this size a round takes minutes. JSON, a markdown
table on stdout, and a PNG with --png.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINED = [sys.executable, "-m", "edgemoe.constrained"]  # a memory / read-rate cgroup


def constrained(memory: str, *cmd, timeout=None):
    """(exit status, peak memory bytes, stdout, stderr) of CMD under the memory cap."""
    r = subprocess.run([*CONSTRAINED, "--memory", memory, "--", *map(str, cmd)],
                       capture_output=True, text=True, timeout=timeout)
    peak = None
    if "constrained: peak memory " in r.stderr:
        peak = int(r.stderr.rsplit("constrained: peak memory ", 1)[1].split()[0])
    return r.returncode, peak, r.stdout, r.stderr


def drop_caches():
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def fio_gbps(files, sizes, seconds: int = 10):
    """fio's O_DIRECT random-read bandwidth over `files` with reads of `sizes` (bytes, in
    the mix they come in), or None without fio."""
    if shutil.which("fio") is None:
        return None
    blocks = [(n + 4095) // 4096 * 4096 for n in sizes]
    mix = {b: blocks.count(b) for b in sorted(set(blocks))}
    shares = [100 * c // len(blocks) for c in mix.values()]
    shares[-1] += 100 - sum(shares)
    r = subprocess.run(["fio", "--name=records", "--filename=" + ":".join(map(str, files)),
                        "--rw=randread", "--bssplit=" + ":".join(
                            f"{b}/{p}" for b, p in zip(mix, shares)),
                        "--direct=1", "--numjobs=2", "--ioengine=psync",
                        f"--runtime={seconds}", "--time_based", "--group_reporting",
                        "--output-format=json"], capture_output=True, text=True, check=True)
    job = json.loads(r.stdout)["jobs"][0]
    return job["read"]["bw_bytes"] / 1e9


def disk_read_bytes() -> int:
    """Bytes this process has made the kernel fetch from storage (page faults included)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("read_bytes:")).split()[1])


# ---- the worker: one configuration, in its own capped process ------------------------

def worker(args):
    # transformers imports torch whenever it is installed (the test extra installs it), which
    # adds ~0.25 GB of libraries to the cgroup's count; a plain `pip install` has no torch, so
    # the workers run as that install does (find_spec sees None)
    sys.modules.setdefault("torch", None)
    import numpy as np

    from edgemoe.streaming.telemetry import peak_rss_bytes

    rng = np.random.default_rng(0)
    if args.worker == "runtime":
        import importlib

        from mlx_lm.utils import load_tokenizer

        importlib.import_module("edgemoe")  # what every edgemoe row loads before the model
        load_tokenizer(Path(args.model))
        print("RESULT " + json.dumps({"peak_rss_bytes": peak_rss_bytes()}))
        return
    if args.worker == "llama.cpp":
        out = llama_cpp_run(args, rng)
    else:
        out = mlx_run(args, rng)
    out["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(out))


def timed_decode(steps, n: int, after_first=lambda: None) -> dict:
    """Time to the first token of `steps`, then decode tok/s and disk bytes per token over
    the next n (`after_first` runs between the two)."""
    tic = time.perf_counter()
    next(steps)
    ttft = time.perf_counter() - tic
    after_first()
    read0, tic = disk_read_bytes(), time.perf_counter()
    for _ in range(n):
        next(steps)
    decode_s = time.perf_counter() - tic
    read = disk_read_bytes() - read0
    return {"ttft_s": ttft, "decode_tok_s": n / decode_s, "decoded": n,
            "disk_gb_per_token": read / n / 1e9, "disk_gbps_decoding": read / decode_s / 1e9}


def llama_cpp_run(args, rng) -> dict:
    from llama_cpp import Llama

    llm = Llama(args.model, n_ctx=args.prompt_tokens + args.max_tokens + 16,
                n_batch=args.prompt_tokens, n_threads=os.cpu_count(), use_mmap=True,
                verbose=False)
    prompt = rng.integers(10, llm.n_vocab() - 10, args.prompt_tokens).tolist()
    return timed_decode(iter(llm.generate(prompt, temp=0.0)), args.max_tokens - 1)


def mlx_run(args, rng) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    if args.worker == "mlx-lm":
        from mlx_lm import load

        model, tokenizer = load(args.model)
        store = None
    else:
        import edgemoe

        model, tokenizer = edgemoe.load(args.model, expert_budget=args.budget, io=args.io,
                                        prefill_arithmetic=args.arithmetic)
        store = model.expert_store
    prompt = mx.array(rng.integers(10, tokenizer.vocab_size - 10, args.prompt_tokens).tolist())
    steps = generate_step(prompt, model, max_tokens=args.max_tokens)
    if store is None:
        return timed_decode(steps, args.max_tokens - 1)
    before = []  # the store's counters once the prompt is done: the decode's apart
    out = timed_decode(steps, args.max_tokens - 1, lambda: before.append(store.snapshot()))
    d = store.snapshot() - before[0]
    n = out["decoded"]
    out.update(gb_read_per_token=d.bytes_read / n / 1e9, read_gbps=d.read_gbps,
               blocked_ms_per_token=1e3 * d.blocked_s / n, hit_rate=d.hit_rate,
               slots_per_layer=store.slots_per_layer, budget_bytes=store.budget_bytes,
               io=store.info().io, page_cache_bytes=store.page_cache_bytes())
    return out


# ---- the driver ------------------------------------------------------------------------

def prepare(args, report):
    ckpt, pack = Path(args.checkpoint), Path(args.pack)
    if not ckpt.exists():
        if not args.make:
            sys.exit(f"bench_large: {ckpt}: no checkpoint; pass --make SIZE to write one")
        tic = time.time()
        rc, peak, _, err = constrained(args.memory, sys.executable,
                                       ROOT / "scripts" / "make_large_checkpoint.py", ckpt,
                                       "--size", args.make, "--experts", args.experts)
        if rc:
            sys.exit(f"bench_large: make_large_checkpoint failed ({rc}): {err[-2000:]}")
        report["make"] = {"seconds": time.time() - tic, "peak_memory_bytes": peak}
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    if not pack.exists() and "pack" in args.sources.split(","):
        drop_caches()
        tic = time.time()
        rc, peak, _, err = constrained(args.memory, sys.executable, "-m", "edgemoe.convert",
                                       "--hf-path", ckpt, "--mlx-path", pack)
        report["convert"] = {"rc": rc, "seconds": time.time() - tic,
                             "peak_memory_bytes": peak}
        if rc:
            sys.exit(f"bench_large: convert failed ({rc}): {err[-2000:]}")
        report["pack_made"] = True
    from edgemoe.format.inplace import open_mlx_lm
    from edgemoe.format.pack import Pack
    from edgemoe.mlx_backend.families import find_experts

    in_place = open_mlx_lm(ckpt, find_experts, verify=False)
    report["slice_bytes"] = [n for _, _, n in in_place.layers[0].records[0].segments]
    source = Pack.open(pack, verify=False) if pack.exists() else in_place
    report["resident_bytes"] = source.resident_bytes
    report["expert_bytes"] = source.expert_bytes
    report["record_bytes"] = source.layers[0].expert_bytes
    return ckpt, pack


def make_gguf(args, report, ckpt: Path, pack: Path) -> Path:
    """The GGUF for llama.cpp, removing the pack this run made when the disk is short."""
    gguf = Path(args.gguf)
    if gguf.exists():
        return gguf
    need = report["checkpoint_bytes"] * 1.02
    if shutil.disk_usage(gguf.parent).free < need:
        if not report.get("pack_made"):
            sys.exit(f"bench_large: {gguf.parent}: {shutil.disk_usage(gguf.parent).free / 1e9:.1f}"
                     f" GB free, the GGUF needs {need / 1e9:.1f} GB")
        shutil.rmtree(pack)  # ours, and its rows are done
        report["pack_removed_for_gguf"] = True
    tic = time.time()
    rc, peak, _, err = constrained(args.memory, sys.executable,
                                   ROOT / "scripts" / "mlx_to_gguf.py", ckpt, gguf)
    report["gguf"] = {"rc": rc, "seconds": time.time() - tic, "peak_memory_bytes": peak}
    if rc:
        sys.exit(f"bench_large: mlx_to_gguf failed ({rc}): {err[-2000:]}")
    return gguf


def run_config(args, name, cmd, fio=None):
    """One configuration in its own capped process, after `fio()` (its files at its read
    sizes) when given."""
    row = {"config": name}
    if fio is not None:
        row["fio_gbps"] = fio()
    drop_caches()
    try:
        rc, peak, out, err = constrained(args.memory, *cmd, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        rc, peak, out, err = "timeout", None, "", f"over --timeout {args.timeout:.0f} s"
    row.update(rc=rc, ran=rc == 0, killed=rc == 137, peak_memory_bytes=peak)
    for line in out.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    if rc and rc != 137:
        lines = [l for l in err.splitlines() if l.strip() and not l.startswith("constrained:")]
        row["error"] = lines[-1] if lines else None
    print(json.dumps(row), file=sys.stderr)
    return row


def plot(report, path):
    plt = pyplot()

    rows = report["runs"]
    names = [r["config"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    a.barh(names, [r.get("decode_tok_s", 0) if r["ran"] else 0 for r in rows])
    a.set_xlabel("decode tok/s (0: killed or failed)")
    b.barh(names, [(r["peak_memory_bytes"] or 0) / 1e9 for r in rows])
    b.axvline(report["memory_cap_bytes"] / 1e9, color="red", ls="--", label="memory cap")
    b.set_xlabel("peak memory, RSS + page cache (GB)")
    b.legend()
    fig.suptitle(f"{report['checkpoint_bytes'] / 1e9:.1f} GB checkpoint under a "
                 f"{report['memory_cap_bytes'] / 1e9:.1f} GB cap")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--pack", required=True)
    p.add_argument("--gguf", default=None, help="llama.cpp's row: the model as GGUF here "
                   "(written if missing; needs pip install -e '.[peers]')")
    p.add_argument("--make", default=None, help="Write a checkpoint of this size if missing")
    p.add_argument("--experts", default="128", help="Experts per layer of a --make checkpoint")
    p.add_argument("--memory", default="8G")
    p.add_argument("--budgets", default="0.05,0.1")
    p.add_argument("--io", default="direct,buffered")
    p.add_argument("--sources", default="pack,inplace")
    p.add_argument("--arithmetic", default="native",
                   help="edgemoe rows' --prefill-arithmetic, comma-separated (native,blas)")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=9)
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--budget", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)

    import importlib.util

    from edgemoe.streaming.budget import parse_budget

    if args.gguf and importlib.util.find_spec("llama_cpp") is None:  # before an hour's run
        sys.exit("bench_large: --gguf runs llama.cpp, which needs llama-cpp-python: "
                 "pip install -e '.[peers]'")
    report = {"memory_cap": args.memory, "memory_cap_bytes": parse_budget(
        args.memory.replace("G", "GiB").replace("M", "MiB"), 0),
        "prompt_tokens": args.prompt_tokens, "runs": []}
    ckpt, pack = prepare(args, report)
    runs = report["runs"]
    me = [sys.executable, __file__, "--checkpoint", ckpt, "--pack", pack,
          "--prompt-tokens", args.prompt_tokens, "--max-tokens", args.max_tokens]
    shards = sorted(ckpt.glob("model*.safetensors"))
    for source in args.sources.split(","):
        model = pack if source == "pack" else ckpt
        files, sizes = (([pack / "experts.bin"], [report["record_bytes"]]) if source == "pack"
                        else (shards, report["slice_bytes"]))
        for budget in args.budgets.split(","):
            for io in args.io.split(","):
                for arithmetic in args.arithmetic.split(","):
                    name = f"edgemoe {source} {float(budget):.0%} {io}" + (
                        f" {arithmetic}" if arithmetic != "native" else "")
                    runs.append(run_config(
                        args, name, [*me, "--worker", "edgemoe", "--model", model, "--budget",
                                     budget, "--io", io, "--arithmetic", arithmetic],
                        fio=lambda: fio_gbps(files, sizes)))
                    save(report, args)
    if args.gguf:
        gguf = make_gguf(args, report, ckpt, pack)
        runs.append(run_config(args, "llama.cpp (mmap)",
                               [*me, "--worker", "llama.cpp", "--model", gguf]))
    if not args.no_mlx_lm:
        runs.append(run_config(args, "mlx-lm (all resident)",
                               [*me, "--worker", "mlx-lm", "--model", ckpt]))
    runs.append(run_config(args, "runtime alone (no model)",
                           [*me, "--worker", "runtime", "--model", ckpt]))
    runtime = runs[-1]["peak_memory_bytes"] or 0
    report["runtime_peak_memory_bytes"] = runtime
    for r in runs:
        if r.get("budget_bytes") is not None and r["peak_memory_bytes"]:
            bound = r["budget_bytes"] + report["resident_bytes"]
            r["bound_bytes"] = bound + 0.5e9  # the bound: budget + resident + 0.5 GB
            r["within_bound"] = r["peak_memory_bytes"] <= r["bound_bytes"]
            r["beyond_runtime_bytes"] = r["peak_memory_bytes"] - runtime
            r["beyond_runtime_within_budget_resident"] = r["beyond_runtime_bytes"] <= bound
        if r.get("read_gbps") and r.get("fio_gbps"):
            r["read_vs_fio"] = r["read_gbps"] / r["fio_gbps"]
    save(report, args)
    print(table(report))
    if args.png:
        plot(report, args.png)


def save(report, args):
    """The report so far (a long run that dies keeps its rows)."""
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))


def table(report) -> str:
    gb = lambda v: "" if v is None else f"{v / 1e9:.2f}"  # noqa: E731
    num = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
    lines = ["| config | ran | TTFT s | decode tok/s | cgroup peak GB | peak RSS GB | "
             "bound GB | disk GB/token | read GB/s | fio GB/s | read/fio | blocked ms/token |",
             "|" + "---|" * 12]
    for r in report["runs"]:
        ran = "yes" if r["ran"] else ("killed (137)" if r["killed"] else f"no ({r['rc']})")
        lines.append("| " + " | ".join([
            r["config"], ran, num(r.get("ttft_s"), "{:.1f}"), num(r.get("decode_tok_s"), "{:.3f}"),
            gb(r["peak_memory_bytes"]), gb(r.get("peak_rss_bytes")), gb(r.get("bound_bytes")),
            num(r.get("disk_gb_per_token")), num(r.get("read_gbps")), num(r.get("fio_gbps")),
            num(r.get("read_vs_fio")), num(r.get("blocked_ms_per_token"), "{:.0f}")]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench_large: needs root (constrained's memory cgroup, dropping caches)")
    main()
