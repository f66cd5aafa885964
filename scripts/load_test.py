"""Load test of `edgemoe.server`: N concurrent requests, for N = 1, 2, 4, 8.

Starts the server on a free loopback port (or uses --url, which must be loopback), sends
a fixed number of rounds of N concurrent greedy completions per N, reads /metrics
before and after each N, prints one row per N, stops the server, and exits. Two kinds of
prompt, side by side, N by N: "unique" (random prompts: every prefill is cold) and
"shared" (every prompt starts with the same --shared-prefix tokens, as a system prompt
or the turns of a conversation do: the prompt cache serves it, and "cached" says how
many prompt tokens per request it served).

    python scripts/load_test.py --model PACK [--expert-budget 25%] [--max-tokens 32]
        [--concurrency 1,4,8] [--shared-prefix 256] [--out DIR]   # DIR: JSON + PNG

Columns: aggregate tok/s (completion tokens / wall time of the rounds), p50 and p95
request latency, mean decode batch, and per generated token (KB): expert bytes read from
disk and unique expert bytes computed on (the union of the batch's experts per layer),
first over prefill and decode, then ("dec") over decode steps only.
"""

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
from plotting import pyplot

# Knobs
CONCURRENCY = [1, 2, 4, 8]
ROUNDS = 2                 # rounds of N concurrent requests per N
PROMPT_TOKENS = (8, 48)    # prompt lengths drawn from this range
START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, *flags: str, tool: str = "load_test") -> tuple:
    """`python -m edgemoe.server --model MODEL FLAGS` on a free loopback port, once its
    /health answers: (process, url). Its log goes to a file (`proc.log`): a pipe nobody
    reads would fill and stop the server at its next warning."""
    port = free_port()
    cmd = [sys.executable, "-m", "edgemoe.server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING", *flags]
    log = tempfile.NamedTemporaryFile("w+", prefix="edgemoe-server-", suffix=".log")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, text=True)
    proc.log = log
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"{tool}: the server exited: {log.read()[-4000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"{tool}: the server did not start within {START_TIMEOUT_S} s")


def one_request(url: str, prompt, max_tokens: int):
    tic = time.perf_counter()
    r = httpx.post(f"{url}/v1/completions", timeout=REQUEST_TIMEOUT_S,
                   json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    usage = r.json()["usage"]
    return (time.perf_counter() - tic, usage["completion_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def run_level(url: str, n: int, max_tokens: int, rng, prefix=(), shared=False) -> dict:
    """N concurrent requests, ROUNDS times; prompts of len(prefix) + 8..48 tokens, which
    start with `prefix` if `shared`, else are random throughout."""
    before = httpx.get(f"{url}/metrics", timeout=30).json()
    latencies, tokens, cached, wall = [], 0, 0, 0.0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(ROUNDS):
            # unique prompts as long as shared ones, so that only the cache differs
            prompts = [(list(prefix) if shared else
                        rng.integers(3, 500, len(prefix)).tolist())
                       + rng.integers(3, 500, rng.integers(*PROMPT_TOKENS)).tolist()
                       for _ in range(n)]
            tic = time.perf_counter()
            for latency, generated, hit in pool.map(
                    lambda p: one_request(url, p, max_tokens), prompts):
                latencies.append(latency)
                tokens += generated
                cached += hit
            wall += time.perf_counter() - tic
    after = httpx.get(f"{url}/metrics", timeout=30).json()
    e0, e1 = before["experts"], after["experts"]
    steps = after["batch"]["steps"] - before["batch"]["steps"]
    rows = after["batch"]["rows"] - before["batch"]["rows"]
    return {
        "prompts": "shared" if shared else "unique", "N": n, "requests": len(latencies),
        "tokens": tokens, "cached_per_request": cached / len(latencies),
        "tok_per_s": tokens / wall,
        "p50_s": float(np.percentile(latencies, 50)),
        "p95_s": float(np.percentile(latencies, 95)),
        "mean_batch": rows / steps if steps else 0.0,
        "read_B_per_tok": (e1["bytes_read"] - e0["bytes_read"]) / tokens,
        "used_B_per_tok": (e1["bytes_used"] - e0["bytes_used"]) / tokens,
        "decode_used_B_per_tok":
            (e1["decode"]["bytes_used"] - e0["decode"]["bytes_used"]) / tokens,
        "decode_read_B_per_tok":
            (e1["decode"]["bytes_read"] - e0["decode"]["bytes_read"]) / tokens,
        "hit_rate": ((e1["hits"] - e0["hits"])  # edgemoe.streaming.stats's definition
                     / max(1, e1["requests"] - e0["requests"])),
        "blocked_s": e1["blocked_s"] - e0["blocked_s"],
    }


def plot(rows, path):
    plt = pyplot()

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for kind in ("unique", "shared"):
        rs = [r for r in rows if r["prompts"] == kind]
        ns = [r["N"] for r in rs]
        a.plot(ns, [r["tok_per_s"] for r in rs], "o-", label=f"{kind} prompts")
        b.plot(ns, [r["p50_s"] for r in rs], "o-", label=f"{kind} p50")
        b.plot(ns, [r["p95_s"] for r in rs], "o--", label=f"{kind} p95")
    a.set(xlabel="concurrent requests", ylabel="tok/s (all requests)", title="throughput")
    b.set(xlabel="concurrent requests", ylabel="latency (s)", title="request latency")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="An edgemoe pack (the script starts a server on it)")
    p.add_argument("--url", help="A running server on loopback instead")
    p.add_argument("--expert-budget", default="25%")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCY)),
                   help="The N to run, e.g. 1,4,8")
    p.add_argument("--shared-prefix", type=int, default=256,
                   help="Tokens every 'shared' prompt starts with (0: unique prompts only)")
    p.add_argument("--json", action="store_true", help="Print rows as JSON lines too")
    p.add_argument("--out", default=None, help="Write load_test.json and load_test.png here")
    args = p.parse_args()
    if bool(args.model) == bool(args.url):
        sys.exit("load_test: give --model or --url")
    levels = [int(n) for n in args.concurrency.split(",")]
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("load_test: --url must be a loopback address")
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args.model, "--expert-budget", args.expert_budget,
                                 "--max-batch", str(max(levels)))
    try:
        rng = np.random.default_rng(0)
        prefix = rng.integers(3, 500, args.shared_prefix).tolist()
        run_level(url, 1, 4, rng)  # warm up: first loads, MLX kernels
        if prefix:
            run_level(url, 1, 1, rng, prefix, shared=True)  # the prefix, cached once
        print(f"{'prompts':>7} {'N':>3} {'reqs':>5} {'tokens':>6} {'cached':>6} {'tok/s':>8} "
              f"{'p50 s':>7} {'p95 s':>7} {'batch':>6} {'read KB/tok':>11} "
              f"{'used KB/tok':>11} {'dec read':>8} {'dec used':>8} {'hit rate':>8} "
              f"{'blocked s':>9}")
        rows = []
        for n in levels:  # the two kinds side by side, level by level
            for kind in (("unique", "shared") if prefix else ("unique",)):
                r = run_level(url, n, args.max_tokens, rng, prefix, shared=kind == "shared")
                rows.append(r)
                print(f"{r['prompts']:>7} {r['N']:>3} {r['requests']:>5} {r['tokens']:>6} "
                      f"{r['cached_per_request']:>6.0f} {r['tok_per_s']:>8.1f} "
                      f"{r['p50_s']:>7.3f} {r['p95_s']:>7.3f} {r['mean_batch']:>6.2f} "
                      f"{r['read_B_per_tok'] / 1e3:>11.1f} {r['used_B_per_tok'] / 1e3:>11.1f} "
                      f"{r['decode_read_B_per_tok'] / 1e3:>8.1f} "
                      f"{r['decode_used_B_per_tok'] / 1e3:>8.1f} "
                      f"{r['hit_rate']:>8.1%} {r['blocked_s']:>9.3f}", flush=True)
                if args.json:
                    print(json.dumps(r), flush=True)
        m = httpx.get(f"{url}/metrics", timeout=30).json()
        print(f"server: {m['tokens']['generated']} tokens at {m['tokens']['tok_per_s']:.1f} "
              f"tok/s of engine time, experts read {m['experts']['bytes_read'] / 1e6:.1f} MB, "
              f"reused {m['experts']['bytes_reused'] / 1e6:.1f} MB, "
              f"{m['experts']['slots_per_layer']} slots per layer; prompt cache "
              f"{m['prompt_cache']['hits']} hits, {m['prompt_cache']['cached_tokens']} tokens")
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "load_test.json").write_text(json.dumps(
                {"model": args.model or args.url, "expert_budget": args.expert_budget,
                 "max_tokens": args.max_tokens, "shared_prefix": args.shared_prefix,
                 "rows": rows, "server": m}, indent=1))
            plot(rows, out / "load_test.png")
            print(f"wrote {out / 'load_test.json'} and {out / 'load_test.png'}")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
