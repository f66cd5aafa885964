"""A model larger than the memory it is given, end to end: make it, convert it, decode it.

    python scripts/bench_large.py --checkpoint DIR --pack DIR [--make 28GB] [--memory 8G]
           [--budgets 0.05,0.1] [--io direct,buffered] [--sources pack,inplace]
           [--prompt-tokens 512] [--max-tokens 6] [--json out.json] [--png out.png]

With --make SIZE and no checkpoint at DIR, scripts/make_large_checkpoint.py writes a
synthetic Qwen3-30B-A3B-shaped mlx-lm int4 checkpoint of that size; with no pack at
--pack, `edgemoe.convert` packs it. Both run under `../shared/tools/constrained --memory`
(a memory cgroup that counts the page cache), as does every configuration after, each in
its own process with the page cache dropped first:

  edgemoe  in place (--sources inplace) and from the pack, at each budget, with each --io
  mlx-lm   mlx_lm.load + generate_step on the same checkpoint (it must hold everything)

Per configuration: whether it ran or was killed (exit 137), time to first token on a
--prompt-tokens prompt, decode tok/s, peak memory (the cgroup's: RSS + page cache), GB
read per decoded token, read GB/s while reading, ms blocked per token; beside `fio` on
the pack's experts file at its record size (O_DIRECT random reads, 2 jobs), when fio is
installed (Debian: apt-get install fio). llama.cpp is not run yet: that needs the
synthetic model written as GGUF (left open in the issue). JSON, and a PNG with --png.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINED = ROOT.parent / "shared" / "tools" / "constrained"


def constrained(memory: str, *cmd, timeout=None):
    """(exit status, peak memory bytes, stdout, stderr) of CMD under the memory cap."""
    r = subprocess.run([str(CONSTRAINED), "--memory", memory, "--", *map(str, cmd)],
                       capture_output=True, text=True, timeout=timeout)
    peak = None
    if "constrained: peak memory " in r.stderr:
        peak = int(r.stderr.rsplit("constrained: peak memory ", 1)[1].split()[0])
    return r.returncode, peak, r.stdout, r.stderr


def drop_caches():
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def fio_gbps(path: Path, record_bytes: int, seconds: int = 15):
    """fio's O_DIRECT random-read bandwidth on `path` at one record per read, or None."""
    if shutil.which("fio") is None:
        return None
    bs = (record_bytes + 4095) // 4096 * 4096
    r = subprocess.run(["fio", "--name=records", f"--filename={path}", "--rw=randread",
                        f"--bs={bs}", "--direct=1", "--numjobs=2", "--ioengine=psync",
                        f"--runtime={seconds}", "--time_based", "--group_reporting",
                        "--output-format=json"], capture_output=True, text=True, check=True)
    job = json.loads(r.stdout)["jobs"][0]
    return job["read"]["bw_bytes"] / 1e9


# ---- the worker: one configuration, in its own capped process ------------------------

def worker(args):
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    rng = np.random.default_rng(0)
    if args.worker == "mlx-lm":
        from mlx_lm import load

        model, tokenizer = load(args.model)
        store = None
    else:
        import edgemoe

        model, tokenizer = edgemoe.load(args.model, expert_budget=args.budget, io=args.io)
        store = model.expert_store
    vocab = tokenizer.vocab_size
    prompt = mx.array(rng.integers(10, vocab - 10, args.prompt_tokens).tolist())
    tic = time.perf_counter()
    steps = generate_step(prompt, model, max_tokens=args.max_tokens)
    token, _ = next(steps)
    ttft = time.perf_counter() - tic
    before = store.snapshot() if store else None
    tic = time.perf_counter()
    n = 0
    for token, _ in steps:
        n += 1
    decode_s = time.perf_counter() - tic
    out = {"ttft_s": ttft, "decode_tok_s": n / decode_s, "decoded": n}
    if store:
        d = store.snapshot() - before
        out.update(gb_read_per_token=d.bytes_read / n / 1e9, read_gbps=d.read_gbps,
                   blocked_ms_per_token=1e3 * d.blocked_s / n, hit_rate=d.hit_rate,
                   slots_per_layer=store.slots_per_layer,
                   budget_bytes=store.budget_bytes, io=store.info().io,
                   page_cache_bytes=store.page_cache_bytes())
    from edgemoe.streaming.telemetry import peak_rss_bytes

    out["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(out))


# ---- the driver ------------------------------------------------------------------------

def prepare(args, report):
    ckpt, pack = Path(args.checkpoint), Path(args.pack)
    if not ckpt.exists():
        if not args.make:
            sys.exit(f"bench_large: {ckpt}: no checkpoint; pass --make SIZE to write one")
        tic = time.time()
        rc, peak, _, err = constrained(args.memory, sys.executable,
                                       ROOT / "scripts" / "make_large_checkpoint.py", ckpt,
                                       "--size", args.make)
        if rc:
            sys.exit(f"bench_large: make_large_checkpoint failed ({rc}): {err[-2000:]}")
        report["make"] = {"seconds": time.time() - tic, "peak_memory_bytes": peak}
    report["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    if not pack.exists():
        drop_caches()
        tic = time.time()
        rc, peak, _, err = constrained(args.memory, sys.executable, "-m", "edgemoe.convert",
                                       "--hf-path", ckpt, "--mlx-path", pack)
        report["convert"] = {"rc": rc, "seconds": time.time() - tic,
                             "peak_memory_bytes": peak}
        if rc:
            sys.exit(f"bench_large: convert failed ({rc}): {err[-2000:]}")
    from edgemoe.format.pack import Pack

    p = Pack.open(pack, verify=False)
    report["resident_bytes"] = p.resident_bytes
    report["expert_bytes"] = p.expert_bytes
    report["record_bytes"] = p.layers[0].expert_bytes
    return ckpt, pack, p


def run_config(args, name, cmd):
    drop_caches()
    rc, peak, out, err = constrained(args.memory, *cmd, timeout=args.timeout)
    row = {"config": name, "rc": rc, "ran": rc == 0, "killed": rc == 137,
           "peak_memory_bytes": peak}
    for line in out.splitlines():
        if line.startswith("RESULT "):
            row.update(json.loads(line[len("RESULT "):]))
    if rc and rc != 137:
        lines = [l for l in err.splitlines() if l.strip() and not l.startswith("constrained:")]
        row["error"] = lines[-1] if lines else None
    print(json.dumps(row), file=sys.stderr)
    return row


def plot(report, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    p.add_argument("--make", default=None, help="Write a checkpoint of this size if missing")
    p.add_argument("--memory", default="8G")
    p.add_argument("--budgets", default="0.05,0.1")
    p.add_argument("--io", default="direct,buffered")
    p.add_argument("--sources", default="pack,inplace")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--max-tokens", type=int, default=6)
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

    from edgemoe.streaming.budget import parse_budget

    report = {"memory_cap": args.memory, "memory_cap_bytes": parse_budget(
        args.memory.replace("G", "GiB").replace("M", "MiB"), 0)}
    ckpt, pack, packed = prepare(args, report)
    report["fio_gbps"] = fio_gbps(pack / "experts.bin", report["record_bytes"])
    common = ["--prompt-tokens", args.prompt_tokens, "--max-tokens", args.max_tokens]
    runs = []
    for source in args.sources.split(","):
        model = pack if source == "pack" else ckpt
        for budget in args.budgets.split(","):
            for io in args.io.split(","):
                name = f"edgemoe {source} {float(budget):.0%} {io}"
                runs.append(run_config(args, name, [
                    sys.executable, __file__, "--checkpoint", ckpt, "--pack", pack,
                    "--worker", "edgemoe", "--model", model, "--budget", budget, "--io", io,
                    *common]))
    if not args.no_mlx_lm:
        runs.append(run_config(args, "mlx-lm (all resident)", [
            sys.executable, __file__, "--checkpoint", ckpt, "--pack", pack,
            "--worker", "mlx-lm", "--model", ckpt, *common]))
    report["runs"] = runs
    for r in runs:
        if r.get("budget_bytes") is not None and r["peak_memory_bytes"]:
            bound = r["budget_bytes"] + report["resident_bytes"] + 0.5e9
            r["within_budget_resident_0.5GB"] = r["peak_memory_bytes"] <= bound
        if r.get("read_gbps") and report["fio_gbps"]:
            r["read_vs_fio"] = r["read_gbps"] / report["fio_gbps"]
    text = json.dumps(report, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    if args.png:
        plot(report, args.png)


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("bench_large: needs root (constrained's memory cgroup, dropping caches)")
    main()
