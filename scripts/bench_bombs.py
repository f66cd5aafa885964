"""Grammar bombs beside a batch: how long 4 greedy completions take alone, beside 1 grammar
bomb and beside 15 (issue #53: 15 stretched 4.45 s to 17.9 s), each bomb's status.

    python scripts/bench_bombs.py [--tree DIR ...] [--rounds 3] [--json OUT]

Each --tree (a checkout of edgemoe; default: this one) serves the bundled model from its
own server, all started at once; rounds alternate between them and the report gives each
tree's medians and ratios, with the load average before and after (a shared machine's
figures are only side by side).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
GOOD = ["import os\n", "class Stack:\n", "for i in range(10):", "The module json"]
BOMB = {"messages": [{"role": "user", "content": "a"}], "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {
            "name": "bomb", "schema": {"type": "string", "pattern": "^(a{700}){700}$"}}}}
TIMEOUT = httpx.Timeout(300.0)


def start(tree: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.Popen([sys.executable, "-m", "edgemoe.server", "--model",
                             str(tree / "edgemoe/models/fine"), "--port", str(port),
                             "--max-batch", "8", "--log-level", "ERROR"], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    proc.kill()
    sys.exit(f"bench_bombs: the server of {tree} did not start")


def greedy(url: str, prompt: str) -> str:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 24,
                                                  "temperature": 0}, timeout=TIMEOUT)
    r.raise_for_status()
    return r.json()["choices"][0]["text"]


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quiesce(pids, most: float = 0.05, limit_s: float = 60):
    """Wait until no server uses over `most` of a core (a bomb's mask its row gave up on
    runs to its end: one tree's must not run during another's round)."""
    deadline = time.time() + limit_s
    while time.time() < deadline:
        before = [cpu_s(p) for p in pids]
        time.sleep(0.5)
        if all(cpu_s(p) - b < most * 0.5 for p, b in zip(pids, before)):
            return


def beside(url: str, bombs: int):
    """(seconds the 4 completions took, their texts, the bombs' statuses)."""
    with ThreadPoolExecutor(len(GOOD) + bombs) as pool:
        bad = [pool.submit(httpx.post, url + "/v1/chat/completions", json=BOMB,
                           timeout=TIMEOUT) for _ in range(bombs)]
        time.sleep(0.05 if bombs else 0)
        tic = time.perf_counter()
        texts = list(pool.map(lambda p: greedy(url, p), GOOD))
        took = time.perf_counter() - tic
        return took, texts, [f.result().status_code for f in bad]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", type=Path)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--bombs", type=int, nargs="+", default=[0, 1, 15])
    p.add_argument("--json")
    args = p.parse_args()
    trees = args.tree or [ROOT]
    servers = [start(t) for t in trees]
    report = {"load_before": open("/proc/loadavg").read().split()[:3], "trees": {}}
    try:
        times = {(t, n): [] for t in trees for n in args.bombs}
        statuses = {(t, n): [] for t in trees for n in args.bombs}
        solo = {t: beside(url, 0)[1] for t, (_, url) in zip(trees, servers)}  # warm
        for _ in range(args.rounds):
            for n in args.bombs:
                for t, (_, url) in zip(trees, servers):
                    quiesce([proc.pid for proc, _ in servers])
                    took, texts, codes = beside(url, n)
                    assert texts == solo[t], f"{t}: a completion changed beside {n} bombs"
                    times[t, n].append(took)
                    statuses[t, n] += codes
                    print(f"{t.name}: {n} bombs: {took:.2f} s {codes}", file=sys.stderr)
        for t in trees:
            alone = statistics.median(times[t, args.bombs[0]])
            report["trees"][str(t)] = {
                f"{n} bombs": {"median_s": round(statistics.median(times[t, n]), 3),
                               "runs_s": [round(x, 3) for x in times[t, n]],
                               "vs_alone": round(statistics.median(times[t, n]) / alone, 2),
                               "bomb_statuses": {str(c): statuses[t, n].count(c)
                                                 for c in sorted(set(statuses[t, n]))}}
                for n in args.bombs}
    finally:
        for proc, _ in servers:
            proc.terminate()
            proc.wait(30)
    report["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(report, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
