"""Load test of `edgemoe.server`: N concurrent requests, for N = 1, 2, 4, 8.

Starts the server on a free loopback port (or uses --url, which must be loopback), sends
a fixed number of rounds of N concurrent greedy completions per N, reads /metrics
before and after each N, prints one row per N, stops the server, and exits.

    python scripts/load_test.py --model PACK [--expert-budget 25%] [--max-tokens 32]

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
from urllib.parse import urlparse

import httpx
import numpy as np

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
    return time.perf_counter() - tic, r.json()["usage"]["completion_tokens"]


def run_level(url: str, n: int, max_tokens: int, rng) -> dict:
    before = httpx.get(f"{url}/metrics", timeout=30).json()
    latencies, tokens, wall = [], 0, 0.0
    with ThreadPoolExecutor(n) as pool:
        for _ in range(ROUNDS):
            prompts = [rng.integers(3, 500, rng.integers(*PROMPT_TOKENS)).tolist()
                       for _ in range(n)]
            tic = time.perf_counter()
            for latency, generated in pool.map(
                    lambda p: one_request(url, p, max_tokens), prompts):
                latencies.append(latency)
                tokens += generated
            wall += time.perf_counter() - tic
    after = httpx.get(f"{url}/metrics", timeout=30).json()
    e0, e1 = before["experts"], after["experts"]
    steps = after["batch"]["steps"] - before["batch"]["steps"]
    rows = after["batch"]["rows"] - before["batch"]["rows"]
    return {
        "N": n, "requests": len(latencies), "tokens": tokens,
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="An edgemoe pack (the script starts a server on it)")
    p.add_argument("--url", help="A running server on loopback instead")
    p.add_argument("--expert-budget", default="25%")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", action="store_true", help="Print rows as JSON lines too")
    args = p.parse_args()
    if bool(args.model) == bool(args.url):
        sys.exit("load_test: give --model or --url")
    proc = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            sys.exit("load_test: --url must be a loopback address")
        url = args.url.rstrip("/")
    else:
        proc, url = start_server(args.model, "--expert-budget", args.expert_budget,
                                 "--max-batch", str(max(CONCURRENCY)))
    try:
        rng = np.random.default_rng(0)
        run_level(url, 1, 4, rng)  # warm up: first loads, MLX kernels
        print(f"{'N':>3} {'reqs':>5} {'tokens':>6} {'tok/s':>8} {'p50 s':>7} {'p95 s':>7} "
              f"{'batch':>6} {'read KB/tok':>11} {'used KB/tok':>11} {'dec read':>8} "
              f"{'dec used':>8} {'hit rate':>8} {'blocked s':>9}")
        for n in CONCURRENCY:
            r = run_level(url, n, args.max_tokens, rng)
            print(f"{r['N']:>3} {r['requests']:>5} {r['tokens']:>6} {r['tok_per_s']:>8.1f} "
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
              f"{m['experts']['slots_per_layer']} slots per layer")
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
