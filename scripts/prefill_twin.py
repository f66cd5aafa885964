"""bench_prefill.py --twin: the twin's prefill against real runs here, look-ahead off and on.

    python -m edgemoe.constrained --read-bps 4M --disk-of . -- \\
        python scripts/bench_prefill.py --twin this-machine.json --prompt-len 256 \\
        --budgets 0.25 --rounds 3 --out DIR

First a warm resident run (100%, the second of two prefills, every expert then in its
slot) measures this machine's compute for the prompt. Then, rounds alternating, cold runs
at each budget with the look-ahead (edgemoe.streaming.prefill_ahead) off and on, each in
its own process, its routing traced. Then the twin of each run from its own trace: the
real store and this machine's reader path, compute replaced by waits calibrated on the
resident run (spread evenly over the layers, `--expert-share` of each to its experts), the
look-ahead as the run had it. A read cap is the whole command's (edgemoe.constrained): the
real runs and the twin read under the same one. Prints and writes `twin.json` under --out:
each run's measured and predicted prefill seconds, and per config their medians.
"""

import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_worker(args, budget, look_ahead: bool, trace=None, warm=False) -> dict:
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_prefill.py"), "--worker",
           "--model", args.model, "--budgets", str(budget), "--prompt-len",
           str(args.prompt_len), "--look-ahead", str(int(look_ahead))]
    cmd += ["--trace", str(trace)] if trace else []
    cmd += ["--warm"] if warm else []
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def replay(run: dict, compute, profile, model: str) -> dict:
    """The twin of one real run, from its trace."""
    from edgemoe.format.pack import Pack
    from edgemoe.streaming.trace import load_trace
    from edgemoe.whatif.twin.engine import TwinConfig, run_twin

    cfg = TwinConfig(budget=str(run["budget"]), mode="native", io="direct", stretch=1.0,
                     mac_reads=False, reader_contends=True, look_ahead=run["look_ahead"])
    r = run_twin(Pack.open(model), load_trace(run["trace"]), compute, profile, cfg)
    return {"predicted_s": r.forecast_prefill_s, "predicted_bytes": r.total_bytes,
            "predicted_blocked_s": r.waits["blocked_s"]}


def check(args, budgets):
    from edgemoe.format.pack import Pack
    from edgemoe.whatif.twin.compute import Compute
    from edgemoe.whatif.twin.profiles import load_profile

    out = Path(args.out)
    (out / "traces").mkdir(parents=True, exist_ok=True)
    profile = load_profile(args.twin)
    base = run_worker(args, 1.0, True, warm=True)
    print(json.dumps(base), flush=True)
    pack = Pack.open(args.model)
    compute = Compute.calibrated(0.0, base["prefill_s"] / base["prompt_len"], len(pack.layers),
                                 pack.top_k, profile.value("host_sync_us") * 1e-6,
                                 args.expert_share)
    runs = []
    for r in range(args.rounds):  # alternate the configurations round by round
        for budget in budgets:
            for ahead in ((False, True) if r % 2 == 0 else (True, False)):
                trace = out / "traces" / f"{budget}_{int(ahead)}_{r}.npz"
                run = dict(run_worker(args, budget, ahead, trace), round=r, trace=str(trace))
                run.update(replay(run, compute, profile, args.model))
                run["error"] = run["predicted_s"] / run["prefill_s"] - 1
                runs.append(run)
                print(json.dumps(runs[-1]), flush=True)
    rows = []
    for budget in budgets:
        for ahead in (False, True):
            mine = [x for x in runs if x["budget"] == budget and x["look_ahead"] == ahead]
            row = {k: statistics.median(x[k] for x in mine)
                   for k in ("prefill_s", "predicted_s", "bytes_read", "blocked_s",
                             "predicted_blocked_s", "prefetches", "prefetches_used")}
            row.update(budget=budget, look_ahead=ahead, rounds=len(mine),
                       error=row["predicted_s"] / row["prefill_s"] - 1,
                       each_error=[x["error"] for x in mine])
            rows.append(row)
    print(f"\nprefill of {args.prompt_len} tokens, {args.model}, one call, cold; compute "
          f"from a warm 100% run ({base['prefill_s']:.2f} s); median of {args.rounds} rounds")
    print("budget  look-ahead  measured s  twin s   error  blocked s (twin)  MB read")
    for row in rows:
        print(f"{row['budget']:>6.0%}  {'on' if row['look_ahead'] else 'off':>10}  "
              f"{row['prefill_s']:10.2f}  {row['predicted_s']:6.2f}  {row['error']:+6.1%}  "
              f"{row['blocked_s']:6.2f} ({row['predicted_blocked_s']:5.2f})  "
              f"{row['bytes_read'] / 1e6:7.1f}")
    (out / "twin.json").write_text(json.dumps(
        {"calibration": base, "runs": runs, "median": rows, "expert_share": args.expert_share,
         "profile": args.twin, "command": " ".join(sys.argv)}, indent=1))
