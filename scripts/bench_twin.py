"""The twin of the streaming pipeline: forecast decode tok/s and prefill time as on a Mac.

    python scripts/bench_twin.py --shape qwen3-30b-a3b --profile m4-pro-24gb \\
        --budget 10%,25% --mode native,prerouted --trace DIR_OR_NPZ[,..] [--json OUT]
    python scripts/bench_twin.py --measure this-machine.json        # this machine's profile
    python scripts/bench_twin.py --validate --json OUT [--rounds 2]  # twin vs real runs here

The real ExpertStore, reader threads, slots and cache policy read real-size records from
a shape pack on this disk (written once under --packs, a few physical layers: see
edgemoe.whatif.twin.shapes), driven by the trace's routing mapped onto the shape; the model's
compute is replaced by timed waits from the profile, stretched by this disk's speed over
the profile's SSD (edgemoe.whatif.twin.engine). Every figure printed for a Mac profile is a
FORECAST of an unvalidated model until --validate has compared the twin with real runs.
--trace takes teacher-forced traces (scripts/routing_stats.py record); switching models'
traces is that one argument. Each trace runs in a fresh store (a cold start per passage)
and the rows sum them, as edgemoe.cache_sim does.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgemoe.streaming.trace import load_trace  # noqa: E402
from edgemoe.whatif.twin.compute import Compute  # noqa: E402
from edgemoe.whatif.twin.engine import TwinConfig, prerouted_layers, run_twin  # noqa: E402
from edgemoe.whatif.twin.forecast import ttft_forecast, ttft_passes  # noqa: E402
from edgemoe.whatif.twin.profiles import load_profile, measure_this_machine  # noqa: E402
from edgemoe.whatif.twin.shapes import (SHAPES, get_shape, map_trace, open_shape_pack,  # noqa: E402
                                 write_shape_pack)

# shape packs are GBs of random records, written once and reused: a cache folder under the
# user's home, as the hub cache is (EDGEMOE_TWIN_PACKS or --packs elsewhere)
DEFAULT_PACKS = Path(os.environ.get("EDGEMOE_TWIN_PACKS") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "edgemoe" / "twin-packs")
DEFAULT_TRACES = ROOT / "edgemoe" / "models" / "fine" / "traces"  # held-out, teacher-forced


def trace_files(spec: str):
    files = []
    for part in spec.split(","):
        p = Path(part)
        files += sorted(p.glob("*.npz")) if p.is_dir() else [p]
    if not files:
        raise SystemExit(f"bench_twin: no .npz traces in {spec}")
    return files


def truncate(trace, max_decode):
    """The trace's first forward calls, up to `max_decode` decoded tokens (shorter runs)."""
    if not max_decode or int(trace["decode"].sum()) <= max_decode:
        return trace
    from edgemoe.whatif.replay import trace_calls
    calls, kept, decoded = trace_calls(trace), [], 0
    for c in calls:
        if trace["decode"][c.start]:
            if decoded == max_decode:
                break
            decoded += c.stop - c.start
        kept.append(c)
    end = kept[-1].stop
    out = {k: v for k, v in trace.items() if not k.startswith("prefetch")}
    out.update(routed=trace["routed"][:end], decode=trace["decode"][:end],
               calls=np.array([c.stop - c.start for c in kept], dtype=np.int32))
    return out


def first_readers(args) -> int:
    return int(str(args.readers).split(",")[0])


def long_prompt(traces, tokens: int, chunk: int) -> dict:
    """A `tokens`-token prompt routed as the traces' tokens were, one after another (and
    round again), prefilled in chunks of `chunk` as mlx-lm does, then one decode step: the
    traces' own prompts are only 128 tokens."""
    routed = np.concatenate([t["routed"] for t in traces])
    routed = routed[np.arange(tokens + 1) % len(routed)]
    calls = [min(chunk, tokens - s) for s in range(0, tokens, chunk)] + [1]
    out = {k: v for k, v in traces[0].items() if k not in ("routed", "decode", "calls")
           and not k.startswith("prefetch")}
    out.update(routed=routed, decode=np.arange(tokens + 1) >= tokens,
               calls=np.array(calls, dtype=np.int32))
    return out


def prefill_rows(args, shape, pack, compute, profile, traces) -> list:
    """TTFT of long prompts (--prompt-tokens), cold: the twin's, and its limit (each
    chunk reads each expert it needs once, overlapped with its compute:
    edgemoe.whatif.twin.forecast.ttft_forecast)."""
    rows = []
    for tokens in (int(t) for t in args.prompt_tokens.split(",")):
        mapped = map_trace(long_prompt(traces, tokens, args.prefill_chunk), shape,
                           seed=args.seed)
        for budget, mode, ahead in ((b, m, a) for b in args.budget.split(",")
                                    for m in args.mode.split(",")
                                    for a in args.look_ahead.split(",")):
            cfg = TwinConfig(budget=budget, mode=mode, policy=args.policy, io=args.io,
                             readers=first_readers(args), stretch=args.stretch,
                             seed=args.seed, cpu_vs_here=args.cpu_vs_here,
                             look_ahead=ahead == "on")
            r = run_twin(pack, mapped, compute, profile, cfg)
            rows.append({"label": "forecast", "shape": shape.name,
                         "profile": profile.name, "budget": budget, "mode": mode,
                         "look_ahead": ahead,
                         "prompt_tokens": tokens, "prefill_chunk": args.prefill_chunk,
                         "forecast_ttft_s": r.forecast_prefill_s,
                         "ttft_limit_s": ttft_forecast(shape, profile, tokens,
                                                       r.slots_per_layer,
                                                       args.prefill_chunk,
                                                       first_readers(args)),
                         "prefill_bytes": r.total_bytes - r.decode_bytes,
                         "stretch": r.stretch,
                         **prefill_terms(r),
                         "schedule": ttft_passes(shape, profile, tokens, r.slots_per_layer,
                                                 args.prefill_chunk, first_readers(args),
                                                 look_ahead=ahead == "on")})
            sched = rows[-1]["schedule"]
            print(f" forecast {shape.name:>16} {profile.name:>13} {budget:>5} {mode:>9} "
                  f"look-ahead {ahead:>3}  TTFT of {tokens} tokens (chunks of {args.prefill_chunk}): "
                  f"{r.forecast_prefill_s:6.2f} s (limit {rows[-1]['ttft_limit_s']:6.2f} s)"
                  f"  {rows[-1]['prefill_bytes'] / 1e9:6.2f} GB read; compute "
                  f"{rows[-1]['compute_s']:.2f} s, Python {rows[-1]['python_s']:.2f} s, "
                  f"reads waited {rows[-1]['blocked_s']:.2f} s; schedule (analytic) "
                  f"{sched['total']:.2f} s: first pass waits {sched['first_pass_wait']:.2f}, "
                  f"pass reads beyond compute {sched['pass_reads_beyond_compute']:.2f}",
                  flush=True)
    return rows


def prefill_terms(r) -> dict:
    """Where a long prompt's forecast seconds went: the compute and syncs asked, the Python
    between waits (dilated), and the rest, waits on reads (the one decode step after it
    is in the first two; the prefill call's own stretch converts)."""
    scale = r.forecast_prefill_s / r.twin_prefill_s
    compute = (r.waits["asked_s"] - r.waits["python_pad_s"]) * scale
    python = (r.waits["python_s"] + r.waits["python_pad_s"]) * scale
    return {"compute_s": compute, "python_s": python,
            "blocked_s": r.forecast_prefill_s - compute - python}


def shape_pack(shape, packs: Path, physical=None):
    folder = packs / shape.name
    if not (folder / "twin.json").exists():
        print(f"writing the {shape.name} shape pack to {folder} ...", file=sys.stderr)
        write_shape_pack(shape, folder, physical)
    return open_shape_pack(folder, shape)


def exact_limit(mapped, budget, compute: Compute, shape, profile, readers) -> dict:
    """max(compute, Belady's decode bytes / the profile's read rate), per decode token."""
    from edgemoe.whatif.replay import simulate
    r = simulate(mapped, budget, "belady")
    per_token = r.decode_bytes_read / max(r.decode_tokens, 1)
    rate = shape.record_bytes / profile.read_s(shape.record_bytes, readers)
    comp = (shape.layers * (compute.resident_layer_s(1) + compute.experts_s(shape.top_k,
                                                                            shape.top_k))
            + compute.head_s)
    return {"belady_bytes_per_token": per_token, "compute_ms_per_token": 1000 * comp,
            "read_ms_per_token": 1000 * per_token / rate,
            "limit_tok_s": 1 / max(comp, per_token / rate)}


def run_rows(args):
    """Every --profile x --shape x --budget x --mode x --readers (or --prompt-tokens)."""
    rows = []
    traces = [truncate(load_trace(f), args.max_decode) for f in trace_files(args.trace)]
    for profile in (load_profile(p) for p in args.profile.split(",")):
        for shape_name in args.shape.split(","):
            shape = get_shape(shape_name)
            pack = shape_pack(shape, Path(args.packs), args.physical_layers)
            compute = Compute.from_profile(profile, shape)
            if args.prompt_tokens:
                rows += prefill_rows(args, shape, pack, compute, profile, traces)
            else:
                rows += decode_rows(args, shape, pack, compute, profile, traces)
    return rows


def decode_rows(args, shape, pack, compute, profile, traces) -> list:
    rows = []
    mapped = [map_trace(t, shape, seed=args.seed) for t in traces]
    for budget in args.budget.split(","):
        limit = None
        if args.limit:
            parts = [exact_limit(m, budget, compute, shape, profile, 2) for m in mapped]
            limit = {k: float(np.mean([p[k] for p in parts])) for k in parts[0]}
        for mode in args.mode.split(","):
            for readers in (int(n) for n in str(args.readers).split(",")):
                cfg = TwinConfig(budget=budget, mode=mode, policy=args.policy, io=args.io,
                                 readers=readers, stretch=args.stretch, recall=args.recall,
                                 seed=args.seed, cpu_vs_here=args.cpu_vs_here)
                results = [run_twin(pack, m, compute, profile, cfg) for m in mapped]
                rows.append(summarize(shape, profile, budget, mode, results, limit))
                print_row(rows[-1])
    return rows


def summarize(shape, profile, budget, mode, results, limit=None) -> dict:
    dec_tokens = sum(r.decode_tokens for r in results)
    dec_forecast_s = sum(r.decode_tokens / r.forecast_decode_tok_s for r in results)
    python_s = sum(r.python_ms_per_token * r.decode_tokens / 1000 for r in results)
    row = {"label": "forecast" if profile.name != "this-machine" else "twin (this machine)",
           "shape": shape.name if shape else None, "profile": profile.name, "budget": budget,
           "mode": mode, "readers": results[0].config["readers"],
           "recall": results[0].config["recall"] if mode == "advisory" else None,
           "forecast_decode_tok_s": dec_tokens / dec_forecast_s,
           # first order: the same run were our Python free (it ran on a busy 2-core VM)
           "forecast_decode_tok_s_without_python": dec_tokens / max(dec_forecast_s - python_s,
                                                                    1e-9),
           "forecast_prefill_s_per_passage": float(np.mean([r.forecast_prefill_s for r in results])),
           "prefill_tokens_per_passage": float(np.mean([r.prefill_tokens for r in results])),
           "decode_bytes_per_token": sum(r.decode_bytes for r in results) / dec_tokens,
           "decode_bytes": sum(r.decode_bytes for r in results),
           "blocked_ms_per_token": float(np.mean([r.blocked_ms_per_token for r in results])),
           "compute_ms_per_token": float(np.mean([r.compute_ms_per_token for r in results])),
           "python_ms_per_token": float(np.mean([r.python_ms_per_token for r in results])),
           "host_syncs_per_token": float(np.mean([r.host_syncs_per_token for r in results])),
           "hit_rate": float(np.mean([r.hit_rate for r in results])),
           "slots_per_layer": results[0].slots_per_layer,
           "stretch": [r.stretch for r in results],
           "stretch_range": [min(r.probe.get("stretch_min", r.stretch) for r in results),
                             max(r.probe.get("stretch_max", r.stretch) for r in results)],
           "read_gbps_here_during_runs": [r.read_gbps_during_run for r in results],
           "compute_method": results[0].compute_method, "traces": len(results),
           "notes": sorted({n for r in results for n in r.notes if not n.startswith("waits")})}
    if limit:
        row["exact_limit"] = limit
    return row


def print_row(r):
    lim = r.get("exact_limit", {}).get("limit_tok_s")
    print(f"{r['label']:>9} {r['shape'] or '-':>16} {r['profile']:>13} {r['budget']:>5} "
          f"{r['mode']:>9}  {r['forecast_decode_tok_s']:7.1f} tok/s "
          f"({r['forecast_decode_tok_s_without_python']:6.1f} w/o Python)"
          + (f" (exact limit {lim:6.1f})" if lim else "")
          + f"  {r['decode_bytes_per_token'] / 1e6:7.2f} MB/tok  blocked "
          f"{r['blocked_ms_per_token']:6.2f} ms  compute {r['compute_ms_per_token']:6.2f} ms  "
          f"python {r['python_ms_per_token']:6.2f} ms  "
          f"prefill {r['forecast_prefill_s_per_passage']:.2f} s  stretch "
          f"{np.mean(r['stretch']):.2f}", flush=True)


# -- validation: the twin with this machine's profile against real runs here --

BENCH = ROOT / "scripts" / "bench_stream.py"


def real_run(kind, pack, args, trace: Path) -> dict:
    """One real end-to-end run in its own process (bench_stream's worker), its routing
    and prefetches traced."""
    cmd = [sys.executable, str(BENCH), "--worker", kind, "--path", str(pack),
           "--prompt-len", str(args.prompt_len), "--decode", str(args.decode),
           "--io", args.io, "--text", args.text, "--forced", "--trace", str(trace),
           "--cache-policy", args.policy, "--readers", str(first_readers(args))]
    if kind.endswith(":prerouted"):
        cmd += ["--prerouter", str(Path(pack) / "prerouter")]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def disk_probe_us(pack_path, args) -> float:
    """This disk's microseconds a record now (256 random reads of the pack's records, the
    run's readers, O_DIRECT as it reads): beside each real run and each twin, so that a
    row whose disk was slower on one side than the other says so (the VM's disk drifts)."""
    from edgemoe.format.pack import Pack
    from edgemoe.whatif.twin.profiles import measure_reads
    pack = Pack.open(pack_path)
    m = measure_reads(pack.experts_path, pack.layers[0].expert_bytes, 256,
                      first_readers(args), direct=args.io == "direct")
    return 1e6 * m["s_per_record"]


def drop_cache(folder: Path):
    for f in Path(folder).glob("*"):
        if f.suffix in (".bin", ".safetensors"):
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def twin_of_run(pack_path, trace_path, kind, compute, profile, args):
    """The twin of one real run from its trace. bench_stream counts decode from its first
    token on, when mlx-lm has already run the next step: the trace's 1-token calls are the
    last prompt token's and then the decode steps, so its window starts at the third."""
    from edgemoe.format.pack import Pack
    pack = Pack.open(pack_path)
    budget, routing = kind.split(":")[:2]
    # the run was traced (every layer syncs); prerouted as the pack's heads route
    heads = prerouted_layers(Path(pack_path) / "prerouter") if routing == "prerouted" else {}
    cfg = TwinConfig(budget=budget, mode=routing, policy=args.policy, io=args.io,
                     readers=first_readers(args), stretch=1.0, skip_decode_calls=2,
                     mac_reads=False, reader_contends=not args.no_contention, traced=True,
                     busy_compute=args.busy_compute, **heads)
    return run_twin(pack, load_trace(trace_path), compute, profile, cfg)


# the predictors' cost, each from a resident run of its mode
PREDICTOR_CALIBRATION = {"prerouted": "1.0:prerouted", "advisory": "1.0:advisory"}


def prefill_s_per_token(run, tokens: int) -> float:
    """The real run's prefill seconds per prompt token: its time to the first token less
    the two decode steps mlx-lm runs before yielding it."""
    real = run["result"]
    return (run["prompt_len"] / real["prompt_tps"] - 2 / real["decode_tps"]) / tokens


def with_measured_predictor(compute, run, layers, profile, args):
    """`compute` plus its mode's predictor cost per layer: what the resident run took
    per decode step and per prompt token beyond its twin without one, over the `layers`
    that run one."""
    real = run["result"]
    twin = twin_of_run(run["model"], run["trace"], run["kind"], compute, profile, args)
    extra_dec = 1 / real["decode_tps"] - 1 / twin.forecast_decode_tok_s
    extra_pre = (prefill_s_per_token(run, twin.prefill_tokens)
                 - twin.forecast_prefill_s / twin.prefill_tokens)
    return compute.with_heads(max(extra_dec, 0.0) / layers, max(extra_pre, 0.0) / layers)


def validate(args):
    """Real runs here (each in its own process, rounds alternating), then the twin of each
    from its own trace, with this machine's profile and compute calibrated on the 100%
    native runs of the same model (the median of the rounds, less the twin's own overhead
    at 100%)."""
    models = [m for m in args.models.split(",") if m]
    kinds = [k for k in args.kinds.split(",") if k]
    out = Path(args.json).with_suffix("")
    (out / "traces").mkdir(parents=True, exist_ok=True)
    runs = []
    for rnd in range(args.rounds):
        for model in models:
            for kind in kinds:
                label = "".join(ch for ch in args.label if ch.isalnum())
                trace = (out / "traces" /
                         f"{Path(model).name}_{kind.replace(':', '_')}_{label}_{rnd}.npz")
                if args.io == "direct":
                    drop_cache(Path(model))
                probe = disk_probe_us(model, args)
                r = real_run(kind, model, args, trace)
                runs.append({"model": model, "kind": kind, "round": rnd, "result": r,
                             "disk_us_per_record": probe,
                             "trace": str(trace), "label": args.label,
                             "prompt_len": args.prompt_len, "decode": args.decode})
                print(f"round {rnd} {Path(model).name} {kind}: {r['decode_tps']:.1f} tok/s, "
                      f"{r.get('expert_bytes_read_per_token', 0) / 1e3:.1f} KB/token", flush=True)
    earlier = {"validation": [], "runs": [], "commands": []}
    if args.append and Path(args.json).exists():  # another model's or read cap's rows
        earlier = json.loads(Path(args.json).read_text())
    write_validation(args, runs, earlier["commands"] + [" ".join(sys.argv)], earlier)


def write_validation(args, runs, commands, earlier=None):
    """Score each run (its twin against it, here: under this process's read cap, if
    any) and write --json, after the rows and runs of `earlier`: `per_run`, and
    `validation`, each config's medians over its rounds."""
    profile = load_profile(args.profile)
    earlier = earlier or {"per_run": [], "runs": []}
    rows = list(earlier.get("per_run", earlier.get("validation", [])))
    for group in sorted({(r["model"], r["label"]) for r in runs}):
        these = [r for r in runs if (r["model"], r["label"]) == group]
        compute = calibrate(these, profile, args)
        rows += [score(run, compute, profile, args) for run in these]
    result = {"validation": by_config(rows), "per_run": rows, "runs": earlier["runs"] + runs,
              "profile": profile.to_json(),
              "method": "twin of each real run from its own routing trace; compute calibrated "
                        "on the 1.0:native runs (the median of the rounds), each predictor's "
                        "on its mode's 1.0 runs (marked calibration_row: not tests); a "
                        "config's row: the medians over its rounds",
              "commands": commands}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")


MEDIANS = ("measured_tok_s", "predicted_tok_s", "measured_ttft_s", "predicted_ttft_s",
           "measured_bytes", "predicted_bytes", "measured_bytes_per_token",
           "predicted_bytes_per_token")


def by_config(rows) -> list:
    """One row per config: the medians of its rounds, and each round's errors."""
    out = []
    for config in dict.fromkeys(r["config"] for r in rows):
        these = [r for r in rows if r["config"] == config]
        row = {"config": config, "rounds": len(these),
               "calibration_row": these[0]["calibration_row"]}
        row.update({k: float(np.median([r[k] for r in these])) for k in MEDIANS})
        row["tok_s_error"] = row["predicted_tok_s"] / row["measured_tok_s"] - 1
        row["ttft_error"] = row["predicted_ttft_s"] / row["measured_ttft_s"] - 1
        row["bytes_error"] = (row["predicted_bytes"] / row["measured_bytes"] - 1
                              if row["measured_bytes"] else 0.0)
        row["round_tok_s_errors"] = [r["tok_s_error"] for r in these]
        # a round beside another busy process measured the two together (2 cores here)
        row["others_cores_max"] = max((r.get("others_cores") or 0.0) for r in these)
        out.append(row)
    return out


def median_run(runs):
    """The runs of one config as one: the medians of their speeds, the first's trace.
    Single runs here vary by up to 30% (one process to the next on this VM), more than
    rounds drift, so compute is calibrated on the median of every round's."""
    first = dict(runs[0])
    first["result"] = dict(first["result"], **{
        k: float(np.median([r["result"][k] for r in runs]))
        for k in ("decode_tps", "prompt_tps")})
    return first


def calibrate(runs, profile, args) -> dict:
    """This machine's compute for one model, from its resident runs (the medians of their
    rounds): per routing mode, with its predictor's cost where a resident run of the mode
    measured it."""
    from edgemoe.format.pack import Pack
    base = [r for r in runs if r["kind"] == "1.0:native"]
    if not base:
        raise SystemExit("--validate needs 1.0:native in --kinds (the calibration run)")
    base = [median_run(base)]
    model, real = base[0]["model"], base[0]["result"]
    zero = Compute(lambda t: 0.0, lambda n, e: 0.0, 0.0,
                   profile.value("host_sync_us") * 1e-6, "zero")
    own = twin_of_run(model, base[0]["trace"], "1.0:native", zero, profile, args)
    own_dec = own.twin_decode_s / max(own.decode_tokens, 1)
    own_pre = own.twin_prefill_s / max(own.prefill_tokens, 1)
    pack = Pack.open(model)
    compute = Compute.calibrated(max(1 / real["decode_tps"] - own_dec, 0.0),
                                 max(prefill_s_per_token(base[0], own.prefill_tokens)
                                     - own_pre, 0.0),
                                 len(pack.layers), pack.top_k,
                                 profile.value("host_sync_us") * 1e-6)
    by_mode = {"native": compute}
    for mode, kind in PREDICTOR_CALIBRATION.items():
        resident = [r for r in runs if r["kind"] == kind]
        by_mode[mode] = (with_measured_predictor(compute, median_run(resident),
                                                 len(pack.layers) - 1, profile, args)
                         if resident else compute)
    return by_mode


def score(run, compute, profile, args) -> dict:
    r, kind = run["result"], run["kind"]
    probe = disk_probe_us(run["model"], args)
    t = twin_of_run(run["model"], run["trace"], kind, compute[kind.split(":")[1]], profile,
                    args)
    measured_bytes = r.get("expert_bytes_read_per_token", 0.0) * (run["decode"] - 1)
    row = {"config": f"{Path(run['model']).name} {kind}"
                     + (f" {run['label']}" if run["label"] else ""),
           "round": run["round"], "label": run["label"],
           "calibration_row": kind in ("1.0:native", *PREDICTOR_CALIBRATION.values()),
           "measured_tok_s": r["decode_tps"], "predicted_tok_s": t.forecast_decode_tok_s,
           "measured_ttft_s": run["prompt_len"] / r["prompt_tps"],
           # mlx-lm yields the first token after the prompt, its last token's step and
           # the next step: the calls before the twin's decode window
           "predicted_ttft_s": t.forecast_ttft_s,
           "measured_bytes": measured_bytes, "predicted_bytes": t.decode_bytes,
           "measured_bytes_per_token": r.get("expert_bytes_read_per_token", 0.0),
           "predicted_bytes_per_token": t.decode_bytes_per_token,
           # where a row misses: the waits on reads, the syncs, the disk while reading
           "measured_blocked_ms": r.get("blocked_ms_per_token", 0.0),
           "predicted_blocked_ms": t.blocked_ms_per_token,
           "measured_syncs_per_token": r.get("host_syncs_per_token", 0.0),
           "predicted_syncs_per_token": t.host_syncs_per_token,
           "measured_read_gbps": r.get("read_gbps", 0.0),
           "predicted_read_gbps": t.read_gbps_during_run,
           # the real run's own CPU, and what other processes took beside it (cores)
           "measured_cpu_cores": r.get("cpu_cores"), "others_cores": r.get("others_cores"),
           # the idle disk's us a record just before the run, and before its twin
           "measured_disk_us": run.get("disk_us_per_record"), "predicted_disk_us": probe}
    row["tok_s_error"] = row["predicted_tok_s"] / row["measured_tok_s"] - 1
    row["ttft_error"] = row["predicted_ttft_s"] / row["measured_ttft_s"] - 1
    row["bytes_error"] = (row["predicted_bytes"] / measured_bytes - 1 if measured_bytes
                          else 0.0)
    print(f"{row['config']:>40} round {run['round']}: tok/s {row['measured_tok_s']:6.1f} "
          f"measured, {row['predicted_tok_s']:6.1f} twin ({row['tok_s_error']:+.1%}); TTFT "
          f"{row['ttft_error']:+.1%}; bytes {row['bytes_error']:+.2%}; blocked "
          f"{row['measured_blocked_ms']:.2f}/{row['predicted_blocked_ms']:.2f} ms, syncs "
          f"{row['measured_syncs_per_token']:.1f}/{row['predicted_syncs_per_token']:.1f}, read "
          f"{row['measured_read_gbps']:.2f}/{row['predicted_read_gbps']:.2f} GB/s "
          f"(measured/twin)" + (f"; others took {row['others_cores']:.2f} cores"
                                if row["others_cores"] is not None else "")
          + (f"; idle disk {row['measured_disk_us']:.0f}/{probe:.0f} us a record"
             if row["measured_disk_us"] is not None else ""), flush=True)
    return row


def backtest(args):
    """The back-test (docs/mac.md, "Back-test"): FORECASTS of the peers' published figures."""
    from edgemoe.whatif.twin import backtest as bt
    traces = [truncate(load_trace(f), args.max_decode) for f in trace_files(args.trace)]
    designs = [d for d in bt.DESIGNS if not args.peers
               or any(p.lower() in d.peer.lower() for p in args.peers.split(","))]
    if not designs:
        raise SystemExit(f"--peers {args.peers}: none of "
                         f"{', '.join(sorted({d.peer for d in bt.DESIGNS}))}")
    saved = json.loads(Path(args.rescore).read_text()) if args.rescore else None
    result = bt.run(traces, designs, seed=args.seed, saved=saved)
    result["command"] = " ".join(sys.argv)
    result["traces"] = [str(f) for f in trace_files(args.trace)]
    print(bt.table(result))
    print(f"{result['within_25pct']} of {result['figures']} published figures within 25% "
          f"(FORECASTS of a model of each peer's design)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return result


# streamlx's examples/sweep.py: its prompt, then greedy decode, 96 tokens of warm-up and 192
# measured. The other prompts are one line each in the bundled model's own domains, so that
# the statistics are a mean over more than one continuation.
GREEDY_PROMPTS = ("The tradeoff between memory bandwidth and storage bandwidth in local "
                  "inference of mixture-of-experts models is",
                  "def read_records(path):", "The function returns", "import os\nimport sys\n")
GREEDY_WARMUP, GREEDY_MEASURED = 96, 192


def record_greedy(out: Path, model_path: Path):
    """Routing traces of the bundled model decoding its own greedy continuation of a one-line
    prompt, as streamlx's sweep measures: the warm-up's tokens are marked as not decode, so a
    replay counts the measured window alone (docs/mac.md, "Back-test": `--routing-check`
    on them gave the measurement that kept the back-test's routing teacher-forced)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    import edgemoe
    model, tokenizer = edgemoe.load(str(model_path), expert_budget=1.0)
    store = model.expert_store
    out.mkdir(parents=True, exist_ok=True)
    for i, prompt in enumerate(GREEDY_PROMPTS):
        trace = store.start_trace()
        steps = generate_step(mx.array(tokenizer.encode(prompt)), model,
                              max_tokens=GREEDY_WARMUP + GREEDY_MEASURED,
                              sampler=lambda logprobs: mx.argmax(logprobs, axis=-1))
        for _ in steps:
            pass
        path = out / f"greedy_{i}.npz"
        trace.save(path)
        t = dict(np.load(path))
        first = int(np.flatnonzero(t["decode"])[0])
        t["decode"][first:first + GREEDY_WARMUP] = False
        np.savez(path, **t)
        print(f"wrote {path}: {int(t['decode'].sum())} measured decode tokens")


def routing_check(args):
    """docs/mac.md, "Shapes": the generator against held-out traces, and --shape's rates."""
    from edgemoe.whatif.twin.routing_gen import check, hit_rates, shape_routing
    files = trace_files(args.trace)
    traces = [load_trace(f) for f in files]
    from edgemoe.streaming.cache import Recency
    policies = ("lfu", "belady", Recency)  # Recency: LRU, the peers' policy (streamlx)
    result = check(traces, [f.stem for f in files], seed=args.seed, policies=policies)
    for key, v in result["mean"].items():
        print(f"  {key:>10}  held out {100 * v['real']:5.1f}%  generated "
              f"{100 * v['generated']:5.1f}%  {v['diff_points']:+.1f} points")
    result["shapes"] = {}
    for name in args.shape.split(","):
        shape = get_shape(name)
        rates = [hit_rates(t, policies=policies)
                 for t in shape_routing(shape, traces, seed=args.seed)]
        mean = {k: float(np.mean([r[k] for r in rates])) for k in rates[0]}
        result["shapes"][name] = mean
        print(f"  {name}: " + ", ".join(f"{k} {100 * v:.1f}%" for k, v in mean.items()))
    result["command"] = " ".join(sys.argv)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--shape", default="qwen3-30b-a3b", help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--profile", default="m4-pro-24gb",
                   help="a profile of edgemoe/whatif/twin/profiles.json or a profile .json")
    p.add_argument("--budget", default="10%,25%")
    p.add_argument("--mode", default="native", help="comma-separated: native,advisory,prerouted")
    p.add_argument("--trace", default=str(DEFAULT_TRACES),
                   help="teacher-forced traces: .npz files or folders, comma-separated")
    p.add_argument("--policy", default="lfu")
    p.add_argument("--readers", default="2", help="reader threads; comma-separated for a "
                                                   "row each (decode rows)")
    p.add_argument("--io", default="direct", choices=("direct", "buffered"))
    p.add_argument("--stretch", type=float, default=None,
                   help="Wait stretch (default: this disk's time per record over the profile's)")
    p.add_argument("--recall", type=float, default=0.8,
                   help="advisory's synthetic predictor (next layer, same token), where the "
                        "traces recorded no prefetches")
    p.add_argument("--max-decode", type=int, default=None,
                   help="Keep each trace's prompt and its first N decoded tokens (shorter runs)")
    p.add_argument("--cpu-vs-here", type=float, default=None,
                   help="The profile's CPU speed for our Python over this machine's (default: "
                        "the profile's figure, 1.0: unsourced and conservative)")
    p.add_argument("--prompt-tokens", default=None, metavar="N[,N..]",
                   help="TTFT of prompts of N tokens instead of decode (routed as the "
                        "traces' tokens, in turn), beside its limit")
    p.add_argument("--prefill-chunk", type=int, default=2048,
                   help="--prompt-tokens: tokens per prefill call (mlx-lm's "
                        "prefill_step_size)")
    p.add_argument("--look-ahead", default="on", metavar="on,off",
                   help="--prompt-tokens: a long prefill's look-ahead (edgemoe.streaming."
                        "prefill_ahead) on, off, or both, one after another")
    p.add_argument("--limit", action="store_true",
                   help="Also the exact-mode limit: max(compute, Belady bytes / read rate)")
    p.add_argument("--packs", default=str(DEFAULT_PACKS), help="Where shape packs are written")
    p.add_argument("--physical-layers", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--measure", default=None, metavar="OUT.json",
                   help="Measure this machine's profile (reads from --read-file) and write it")
    p.add_argument("--read-file", default=None, help="A large file to read for --measure")
    p.add_argument("--validate", action="store_true")
    p.add_argument("--backtest", action="store_true",
                   help="Forecast every peer's published Mac figure from its design "
                        "(edgemoe.whatif.twin.backtest) and print the table; --json writes it; "
                        "--peers NAME[,..] and --max-decode shorten it; --rescore JSON takes "
                        "the misses an earlier --json replayed and reruns the timing model")
    p.add_argument("--at-peers", action="store_true",
                   help="edgemoe's analytic forecast at each peer's own setting and at 100%%, "
                        "native and prerouted, today's decode path beside the one before it")
    p.add_argument("--peers", default=None, help="--backtest: only these peers (substring)")
    p.add_argument("--no-contention", action="store_true",
                   help="--validate: the twin without the reader's CPU time slowing compute "
                        "(as it was before #51)")
    p.add_argument("--busy-compute", action="store_true",
                   help="--validate: the twin's compute waits keep a core busy instead of "
                        "sleeping, as the real compute does on this CPU (the readers then "
                        "find the cores as taken as beside it)")
    p.add_argument("--record-greedy", default=None, metavar="DIR",
                   help="Record the bundled model's greedy-decode routing traces, as "
                        "streamlx's sweep decodes, into DIR (for --routing-check)")
    p.add_argument("--routing-check", action="store_true",
                   help="Generated routing against the held-out traces (leave one out), and "
                        "the hit rates of --shape's generated routing beside the traces'")
    p.add_argument("--models", default=str(ROOT / "edgemoe" / "models" / "fine"),
                   help="--validate: edgemoe packs, comma-separated")
    p.add_argument("--kinds", default="1.0:native,0.25:native,0.1:native,0.25:advisory,"
                                      "0.1:advisory,1.0:prerouted,0.25:prerouted,0.1:prerouted",
                   help="--validate: bench_stream worker configs (budget:routing)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--rescore", default=None, metavar="JSON",
                   help="Score the real runs of a --validate JSON again (after a change to "
                        "the twin): those of --label (run it under the same read cap); "
                        "writes --json (default: the same file)")
    p.add_argument("--append", action="store_true",
                   help="--validate: add the rows to those already in --json (another "
                        "model, or a run under a read cap)")
    p.add_argument("--label", default="",
                   help="--validate: appended to each row's config (e.g. 'at 20 MB/s')")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--text", default=None,
                   help="--validate: held-out text to prompt the real runs with (required)")
    args = p.parse_args(argv)
    if args.measure:
        if not args.read_file:
            raise SystemExit("--measure needs --read-file (a file of a few GB, e.g. a shape "
                             "pack's experts.bin)")
        prof = measure_this_machine(Path(args.read_file))
        Path(args.measure).write_text(json.dumps(prof.to_json(), indent=1))
        print(json.dumps({k: v["value"] for k, v in prof.figures.items()}, indent=1))
        return
    if args.record_greedy:
        return record_greedy(Path(args.record_greedy), Path(args.models.split(",")[0]))
    if args.backtest:
        return backtest(args)
    if args.at_peers:
        return at_peers(args)
    if args.routing_check:
        return routing_check(args)
    if args.rescore:  # the twin again, against the real runs a --json already holds
        saved = json.loads(Path(args.rescore).read_text())
        args.json = args.json or args.rescore
        mine = [r for r in saved["runs"] if r["label"] == args.label]
        kept = {"per_run": [row for row in saved.get("per_run", saved["validation"])
                            if row.get("label", "") != args.label],
                "runs": [r for r in saved["runs"] if r["label"] != args.label]}
        return write_validation(args, mine, saved["commands"] + [" ".join(sys.argv)], kept)
    if args.validate:
        if args.profile == "m4-pro-24gb":
            args.profile = "this-machine.json"
        if not Path(args.profile).exists():
            raise SystemExit(f"--validate: {args.profile}: measure it first (--measure)")
        if not args.json:
            raise SystemExit("--validate needs --json OUT")
        if not args.text or not Path(args.text).exists():
            raise SystemExit(f"--validate needs --text FILE (held-out text for the real runs' "
                             f"prompts; found {args.text})")
        return validate(args)
    rows = run_rows(args)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)},
                                              indent=1))
        print(f"wrote {args.json}")


def at_peers(args):
    """FORECAST: edgemoe beside each peer at the peer's setting (docs/mac.md, "At the
    peers' settings")."""
    from edgemoe.streaming.trace import load_trace
    from edgemoe.whatif.twin.backtest import ours_at_peers
    files = [Path(t) for t in args.trace.split(",")]
    files = [f for p in files for f in (sorted(p.glob("*.npz")) if p.is_dir() else [p])]
    rows = ours_at_peers([load_trace(f) for f in files])
    print(f"FORECAST (analytic), tok/s; before = two host syncs a streamed layer (prerouted "
          f"one), today = one (none held whole; prerouted one a token)")
    for r in rows:
        print(f"  {r['peer']:>17} {r['shape']:>16} {r['profile']:>12} {r['budget']:>8} "
              f"published {r['published']:>10}: native {r['native_before']:5.1f} -> "
              f"{r['native_today']:5.1f}, prerouted {r['prerouted_before']:5.1f} -> "
              f"{r['prerouted_today']:5.1f} (syncs {r['sync_ms_before']:.1f} -> "
              f"{r['sync_ms_today']:.1f} ms, reads {r['read_ms']:.1f} ms, compute "
              f"{r['compute_ms']:.1f} ms)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "command": " ".join(sys.argv)},
                                              indent=1))
        print(f"wrote {args.json}")
    return rows


if __name__ == "__main__":
    main()
