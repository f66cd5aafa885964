"""Benchmark: prefill under a small budget, passes read one after another vs read ahead.

A long prompt under a budget smaller than its experts is computed layer by layer in
passes of experts that fit the slots (edgemoe.streaming.calls). Read ahead (the default),
each pass is half the pool and the next pass reads into the other half while it computes;
serial, each pass is the whole pool and reads wait for compute. Each configuration runs in
its own process, cold (O_DIRECT, page cache dropped), optionally under a disk read-rate cap
(`edgemoe.constrained --read-bps`), in alternating rounds. Prints and writes JSON
and a PNG: prefill seconds, expert bytes read, read rate achieved, seconds blocked on reads.

    python scripts/bench_prefill.py [--model PACK] [--prompt-len 512] [--budgets 0.1,0.25]
                                    [--read-bps 20M] [--rounds 3] [--out bench_prefill]

`--profile`: where a prefill's time goes, in one process, warm: mlx-lm, then edgemoe at
each budget with native and BLAS arithmetic (edgemoe.mlx_backend.prefill), in alternating
rounds. Each op is timed with its inputs evaluated before and its output after (so the
ops run one after another, as MLX's CPU backend runs them anyway): attention's
projections, the rest of attention (scaled dot-product, RoPE, norms), the routers, the
experts' matmuls, the store's wait on reads, the streaming layer's own host work (slots,
routing sync, passes) and the LM head. JSON and a PNG.

    python scripts/bench_prefill.py --profile [--mlx-lm DIR] [--prompt-len 1024]
                                    [--budgets 1.0,0.25] [--rounds 3] [--out DIR]

`--peers`: time to first token of one prompt of random token ids, each configuration in its
own process, page cache warm, alternating rounds: llama.cpp on the same model as GGUF
(scripts/mlx_to_gguf.py; llama-cpp-python from the peers extra, run by `--llama-python`,
which may be another venv's), mlx-lm (`--mlx-lm`), and edgemoe at each budget with native
and BLAS arithmetic, all prefilling in chunks of 2048 tokens.

    python scripts/bench_prefill.py --peers --gguf FILE --llama-python PY --mlx-lm DIR
                                    [--prompt-len 1024] [--budgets 1.0,0.25] [--out DIR]

`--twin PROFILE`: the twin's prefill against real runs here, the look-ahead of a long
prefill (edgemoe.streaming.prefill_ahead) off and on (scripts/prefill_twin.py).
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINED = [sys.executable, "-m", "edgemoe.constrained"]  # a memory / read-rate cgroup


def worker(model: str, budget: float, prompt_len: int, read_ahead: bool,
           look_ahead: bool = True, trace: str = None, warm: bool = False) -> dict:
    """One prefill of the whole prompt in one forward call, cold (O_DIRECT); `warm`: the
    second of two (at 100%, every expert then in its slot: compute alone); `trace`: its
    routing saved there (for the twin: scripts/prefill_twin.py)."""
    import time

    import mlx.core as mx

    import edgemoe
    from edgemoe.streaming import calls, prefill_ahead

    calls.READ_AHEAD = read_ahead
    prefill_ahead.LOOK_AHEAD = look_ahead
    m, tokenizer = edgemoe.load(model, expert_budget=budget, io="direct")
    text = (ROOT / "edgemoe" / "streaming" / "slots.py").read_text() * 4
    tokens = mx.array(tokenizer.encode(text)[:prompt_len])
    store = m.expert_store
    if warm:
        mx.eval(m(tokens[None]))
    recorder = store.start_trace() if trace else None
    before = store.snapshot()
    tic = time.perf_counter()
    mx.eval(m(tokens[None]))
    seconds = time.perf_counter() - tic
    stats = store.snapshot() - before
    if recorder is not None:
        recorder.save(trace)
    return {"read_ahead": read_ahead, "look_ahead": look_ahead, "budget": budget,
            "prompt_len": int(tokens.size), "warm": warm,
            "prefill_s": seconds, "tok_per_s": tokens.size / seconds,
            "bytes_read": stats.bytes_read, "read_mb_per_s": stats.bytes_read / seconds / 1e6,
            "blocked_s": stats.blocked_s, "loads": stats.loads, "prefetches": stats.prefetches,
            "prefetches_used": stats.predicted_used, "slots": store.slots_per_layer}


def run_one(args, budget, read_ahead) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--model", args.model,
           "--budgets", str(budget), "--prompt-len", str(args.prompt_len),
           "--read-ahead", str(int(read_ahead))]
    if args.read_bps:
        cmd = [*CONSTRAINED, "--read-bps", args.read_bps, "--disk-of", args.model, "--"] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(ROOT / "edgemoe" / "models" / "fine"))
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--budgets", default="0.1,0.25")
    p.add_argument("--read-bps", help="cap the disk's read rate, e.g. 20M (needs root)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench_prefill")
    p.add_argument("--profile", action="store_true", help="where the time goes (see above)")
    p.add_argument("--mlx-lm", help="--profile: the model as an mlx-lm checkpoint, for "
                                    "mlx-lm's own row (tests/unpack.py writes one from a pack)")
    p.add_argument("--peers", action="store_true", help="TTFT beside llama.cpp (see above)")
    p.add_argument("--gguf", help="--peers: the model as GGUF, for llama.cpp's row")
    p.add_argument("--llama-python", default=sys.executable,
                   help="--peers: the Python that has llama-cpp-python")
    p.add_argument("--twin", metavar="PROFILE",
                   help="the twin against real runs here, look-ahead off and on (see "
                        "scripts/prefill_twin.py); PROFILE: this machine's (bench_twin "
                        "--measure)")
    p.add_argument("--expert-share", type=float, default=0.5,
                   help="--twin: the experts' share of a layer's compute")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--read-ahead", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--look-ahead", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    budgets = [float(b) for b in args.budgets.split(",")]
    if args.worker:
        print(json.dumps(worker(args.model, budgets[0], args.prompt_len, bool(args.read_ahead),
                                bool(args.look_ahead), args.trace, args.warm)))
        return
    if args.twin:
        from prefill_twin import check
        check(args, budgets)
        return
    if args.profile:
        from prefill_profile import profile
        profile(args, budgets)
        return
    if args.peers:
        from prefill_profile import peers
        peers(args, budgets)
        return
    runs = []
    for r in range(args.rounds):  # alternate the configurations round by round
        for budget in budgets:
            for read_ahead in ((False, True) if r % 2 == 0 else (True, False)):
                runs.append(dict(run_one(args, budget, read_ahead), round=r))
                print(json.dumps(runs[-1]), flush=True)
    rows = []
    for budget in budgets:
        for read_ahead in (False, True):
            mine = [x for x in runs if x["budget"] == budget and x["read_ahead"] == read_ahead]
            rows.append({k: statistics.median(x[k] for x in mine)
                         for k in ("prefill_s", "tok_per_s", "bytes_read", "read_mb_per_s",
                                   "blocked_s")} | {"budget": budget, "read_ahead": read_ahead})
    print(f"\nprefill of {args.prompt_len} tokens, {args.model}, read cap {args.read_bps or 'none'}"
          f", median of {args.rounds} rounds")
    print("budget  passes      prefill s  tok/s  MB read  MB/s  blocked s  speedup")
    for budget in budgets:
        serial, ahead = (next(x for x in rows if x["budget"] == budget and x["read_ahead"] == a)
                         for a in (False, True))
        for row in (serial, ahead):
            print(f"{budget:>6.0%}  {'read ahead' if row['read_ahead'] else 'serial':<10}  "
                  f"{row['prefill_s']:9.2f}  {row['tok_per_s']:5.0f}  "
                  f"{row['bytes_read'] / 1e6:7.1f}  {row['read_mb_per_s']:4.1f}  "
                  f"{row['blocked_s']:9.2f}  {serial['prefill_s'] / row['prefill_s']:6.2f}x")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill.json").write_text(json.dumps({"runs": runs, "median": rows,
                                                  "read_bps": args.read_bps}, indent=1))
    _plot(rows, budgets, out / "prefill.png", args)


def _plot(rows, budgets, path, args):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.35
    for i, read_ahead in enumerate((False, True)):
        values = [next(x["prefill_s"] for x in rows
                       if x["budget"] == b and x["read_ahead"] == read_ahead) for b in budgets]
        ax.bar([j + i * width for j in range(len(budgets))], values, width,
               label="read ahead" if read_ahead else "serial passes")
    ax.set_xticks([j + width / 2 for j in range(len(budgets))], [f"{b:.0%}" for b in budgets])
    ax.set_xlabel("expert budget")
    ax.set_ylabel(f"prefill of {args.prompt_len} tokens (s)")
    ax.set_title(f"read cap {args.read_bps or 'none'}, cold, median of {args.rounds}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
