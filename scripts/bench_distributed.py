"""Several hosts as one, measured: 1, 2 and 4 processes on loopback, each in its own cap.

    sudo python scripts/bench_distributed.py --model CKPT [--make 4.5GB] [--hosts 1,2,4]
           [--memory 2G] [--read-bps 20M] [--budget auto] [--io direct]
           [--prompt-tokens 32] [--max-tokens 16] [--rounds 2] [--json out.json] [--png out.png]

Each host is a process under `edgemoe.constrained --memory` (a memory cgroup that
counts the page cache; with --read-bps, a read-rate cap of its own, as if each host had its
own SSD), joined to the others by MLX's ring backend over 127.0.0.1 (MLX_RANK and
MLX_HOSTFILE set as mlx.launch sets them). The model should not fit one host's cap but fit
the group's. With --make and no checkpoint at --model, scripts/make_large_checkpoint.py
writes a synthetic Qwen3-30B-A3B-shaped int4 checkpoint of that size. The page cache is
dropped before each configuration; group sizes alternate over --rounds.

Per group size: decode tok/s (host 0's), per host the cgroup's peak memory and peak RSS,
expert bytes read per token (the store's count, and the disk's from /proc/self/io), the
share of decode time spent in all_sum (waiting for the other hosts included), and the
greedy tokens (every size must give the same). JSON, a markdown table, a PNG with --png.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINED = [sys.executable, "-m", "edgemoe.constrained"]  # a memory / read-rate cgroup
sys.path.insert(0, str(ROOT / "scripts"))


def worker(args):
    """One host: load, prefill, decode; print RESULT json."""
    sys.modules.setdefault("torch", None)  # as a plain install (see bench_large)
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step

    import edgemoe
    from edgemoe.distributed import connect
    from edgemoe.streaming.telemetry import peak_rss_bytes

    from bench_large import disk_read_bytes

    hosts = int(os.environ.get("BENCH_HOSTS", "1"))
    group = connect(120) if hosts > 1 else None
    model, tokenizer = edgemoe.load(args.model, expert_budget=args.budget, io=args.io,
                                    group=group, group_timeout=300)
    streaming = edgemoe.streaming_of(model)
    store, share = streaming.store, streaming.share
    rng = np.random.default_rng(0)
    prompt = mx.array(rng.integers(100, 1000, size=args.prompt_tokens))
    steps = generate_step(prompt, model, max_tokens=args.max_tokens + 1)
    tic = time.perf_counter()
    tokens = [next(steps)[0]]
    ttft = time.perf_counter() - tic
    stats0, disk0 = store.snapshot(), disk_read_bytes()
    waited0 = share.watch.collective_s if share else 0.0
    tic = time.perf_counter()
    for _ in range(args.max_tokens):
        tokens.append(next(steps)[0])
    decode_s = time.perf_counter() - tic
    stats = store.snapshot() - stats0
    n = args.max_tokens
    info = store.info()
    print("RESULT " + json.dumps({
        "rank": group.rank() if group else 0, "ttft_s": ttft, "decode_tok_s": n / decode_s,
        "expert_mb_per_token": stats.bytes_read / n / 1e6,
        "disk_mb_per_token": (disk_read_bytes() - disk0) / n / 1e6,
        "all_sum_share": ((share.watch.collective_s - waited0) / decode_s) if share else 0.0,
        "hit_rate": stats.hit_rate, "blocked_ms_per_token": 1000 * stats.blocked_s / n,
        "slots_per_layer": info.slots_per_layer, "experts_per_layer": info.experts_per_layer,
        "budget_gb": info.slot_bytes / 1e9, "peak_rss_gb": peak_rss_bytes() / 1e9,
        "tokens": [int(t) for t in tokens]}), flush=True)
    store.close()


def iec_bytes(text: str) -> int:
    """A size as constrained reads it (numfmt --from=iec: 2G is 2 GiB)."""
    units = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
    text = text.strip().upper()
    return int(float(text.rstrip("KMGT")) * units[text[len(text.rstrip("KMGT")):]])


def free_ports(n: int) -> int:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        base = socks[0].getsockname()[1]
    finally:
        for s in socks:
            s.close()
    for attempt in range(100):  # n consecutive free ports from base
        try:
            taken = [socket.socket() for _ in range(n)]
            for i, s in enumerate(taken):
                s.bind(("127.0.0.1", base + i))
            for s in taken:
                s.close()
            return base
        except OSError:
            for s in taken:
                s.close()
            base += n
    raise RuntimeError("no free ports")


def run_group(args, hosts: int, out_dir: Path) -> dict:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    base = free_ports(hosts)
    hostfile = out_dir / f"hosts-{hosts}.json"
    hostfile.write_text(json.dumps([[f"127.0.0.1:{base + r}"] for r in range(hosts)]))
    cap = ["--memory", args.memory] + (["--read-bps", args.read_bps] if args.read_bps else [])
    procs = []
    for rank in range(hosts):
        env = {**os.environ, "MLX_RANK": str(rank), "MLX_HOSTFILE": str(hostfile),
               "BENCH_HOSTS": str(hosts)}
        cmd = [*CONSTRAINED, *cap, "--", sys.executable, __file__, "--worker",
               "--model", args.model, "--budget", args.budget, "--io", args.io,
               "--prompt-tokens", str(args.prompt_tokens), "--max-tokens", str(args.max_tokens)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    row = {"hosts": hosts, "memory_per_host": args.memory, "read_bps": args.read_bps,
           "per_host": []}
    for rank, p in enumerate(procs):
        stdout, stderr = p.communicate(timeout=args.timeout)
        host = {"rank": rank, "exit": p.returncode}
        if "constrained: peak memory " in stderr:
            host["peak_memory_gb"] = int(stderr.rsplit("constrained: peak memory ", 1)[1]
                                         .split()[0]) / 1e9
        results = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
        if results:
            host.update(json.loads(results[-1][len("RESULT "):]))
        else:
            host["error"] = stderr.strip().splitlines()[-3:] if stderr.strip() else []
        row["per_host"].append(host)
    ok = all("decode_tok_s" in h for h in row["per_host"])
    row["ok"] = ok
    if ok:
        h0 = row["per_host"][0]
        row.update(decode_tok_s=h0["decode_tok_s"], ttft_s=h0["ttft_s"],
                   tokens=h0["tokens"],
                   same_tokens_on_hosts=all(h["tokens"] == h0["tokens"] for h in row["per_host"]),
                   max_peak_memory_gb=max(h.get("peak_memory_gb", 0) for h in row["per_host"]),
                   expert_mb_per_token_per_host=[h["expert_mb_per_token"] for h in row["per_host"]],
                   all_sum_share=max(h["all_sum_share"] for h in row["per_host"]))
    return row


def summarize(report: dict):
    by = {}
    for row in report["runs"]:
        by.setdefault(row["hosts"], []).append(row)
    summary = []
    for hosts, rows in sorted(by.items()):
        good = [r for r in rows if r["ok"]]
        if not good:
            summary.append({"hosts": hosts, "ok": False})
            continue
        med = lambda key: sorted(r[key] for r in good)[len(good) // 2]
        per_host = lambda key: [sorted(r["per_host"][i][key] for r in good)[len(good) // 2]
                                for i in range(hosts)]
        summary.append({"hosts": hosts, "ok": True, "rounds": len(good),
                        "decode_tok_s": med("decode_tok_s"), "ttft_s": med("ttft_s"),
                        "peak_memory_gb": per_host("peak_memory_gb"),
                        "peak_rss_gb": per_host("peak_rss_gb"),
                        "expert_mb_per_token": per_host("expert_mb_per_token"),
                        "disk_mb_per_token": per_host("disk_mb_per_token"),
                        "all_sum_share": per_host("all_sum_share"),
                        "hit_rate": per_host("hit_rate"),
                        "slots_per_layer": good[0]["per_host"][0]["slots_per_layer"],
                        "experts_per_layer": good[0]["per_host"][0]["experts_per_layer"],
                        "same_tokens_on_hosts": all(r["same_tokens_on_hosts"] for r in good),
                        "tokens": good[0]["tokens"]})
    base = next((s for s in summary if s["ok"] and s["hosts"] == min(by)), None)
    for s in summary:
        if s["ok"] and base is not None:
            s["same_tokens_as_fewest_hosts"] = s["tokens"] == base["tokens"]
            s["speedup"] = s["decode_tok_s"] / base["decode_tok_s"]
    report["summary"] = summary


def table(report) -> str:
    lines = ["| hosts | slots/layer of experts/layer | decode tok/s | x 1 host | peak memory per "
             "host GB | expert MB read per token per host | disk MB per token per host | "
             "all_sum share of decode | tokens equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda xs, f: ", ".join(f.format(x) for x in xs)
    for s in report["summary"]:
        if not s["ok"]:
            lines.append(f"| {s['hosts']} | failed | | | | | | | |")
            continue
        lines.append(
            f"| {s['hosts']} | {s['slots_per_layer']} of {s['experts_per_layer']} | "
            f"{s['decode_tok_s']:.2f} | {s.get('speedup', 1):.2f} | "
            f"{fmt(s['peak_memory_gb'], '{:.2f}')} | {fmt(s['expert_mb_per_token'], '{:.1f}')} | "
            f"{fmt(s['disk_mb_per_token'], '{:.1f}')} | {fmt(s['all_sum_share'], '{:.0%}')} | "
            f"{'yes' if s['same_tokens_on_hosts'] and s.get('same_tokens_as_fewest_hosts') else 'NO'} |")
    return "\n".join(lines)


def plot(report, path):
    plt = pyplot()

    rows = [s for s in report["summary"] if s["ok"]]
    hosts = [str(s["hosts"]) for s in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    axes[0].bar(hosts, [s["decode_tok_s"] for s in rows], color="tab:blue")
    axes[0].set_title("decode tok/s")
    axes[1].bar(hosts, [sum(s["expert_mb_per_token"]) for s in rows], color="tab:orange")
    axes[1].set_title("expert MB read per token (all hosts)")
    axes[2].bar(hosts, [max(s["peak_memory_gb"]) for s in rows], color="tab:green")
    axes[2].axhline(float(report["memory_per_host_gb"]), color="k", ls="--", lw=1,
                    label="cap per host")
    axes[2].set_title("peak memory per host, GB (cgroup)")
    axes[2].legend()
    for ax in axes:
        ax.set_xlabel("hosts")
    fig.suptitle(f"{report['model_gb']:.1f} GB model, {report['memory_per_host']} per host"
                 + (f", reads capped at {report['read_bps']}/s per host"
                    if report["read_bps"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="An mlx-lm checkpoint or an edgemoe pack")
    p.add_argument("--make", default=None, help="Write a synthetic checkpoint this size if "
                                                "--model is missing")
    p.add_argument("--hosts", default="1,2,4")
    p.add_argument("--memory", default="2G", help="The cap of each host")
    p.add_argument("--read-bps", default=None, help="A read-rate cap of each host")
    p.add_argument("--budget", default="auto")
    p.add_argument("--io", default="direct", choices=("direct", "buffered"))
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=None)
    p.add_argument("--png", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if os.geteuid() != 0:
        sys.exit("bench_distributed: needs root (edgemoe.constrained makes cgroups)")
    model = Path(args.model)
    if not model.exists():
        if args.make is None:
            sys.exit(f"bench_distributed: {model}: no such model (pass --make SIZE to write one)")
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_large_checkpoint.py"),
                        str(model), "--size", args.make], check=True)
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.families import find_experts

    source = open_source(model, verify=False, find_experts=find_experts)
    report = {"model": str(model), "model_gb": (source.expert_bytes + source.resident_bytes) / 1e9,
              "expert_gb": source.expert_bytes / 1e9, "memory_per_host": args.memory,
              "memory_per_host_gb": iec_bytes(args.memory) / 1e9,
              "read_bps": args.read_bps, "budget": args.budget, "io": args.io,
              "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
              "cpus": os.cpu_count(), "runs": []}
    out_dir = Path(args.json).parent if args.json else Path(".")
    hosts = [int(h) for h in args.hosts.split(",")]
    for round_ in range(args.rounds):
        for n in (hosts if round_ % 2 == 0 else hosts[::-1]):
            print(f"[bench_distributed] round {round_ + 1}: {n} host(s)", file=sys.stderr,
                  flush=True)
            row = run_group(args, n, out_dir)
            row["round"] = round_
            report["runs"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "per_host"}),
                  file=sys.stderr, flush=True)
            summarize(report)
            if args.json:
                Path(args.json).write_text(json.dumps(report, indent=1))
    print(table(report))
    if args.png:
        plot(report, args.png)


if __name__ == "__main__":
    main()
