"""Benchmark: mlx-lm fully resident vs edgemoe at several expert budgets, side by side.

Each configuration runs in its own process (so peak RSS is its own), and the rounds
alternate configurations so that drift of the machine hits them all alike. Prints
decode tok/s as a ratio to mlx-lm resident, peak MLX memory, peak RSS, page cache held
by the model's files, expert bytes read per token and ms blocked per token; writes
JSON and a PNG chart.

    python scripts/bench_stream.py [--mlx-model MLX_INT4_DIR --pack PACK_DIR] [--out bench_out]
                                   [--cold] [--fio] [--prerouter HEADS_DIR] [--adapter-path LORA_DIR]
                                   [--read-bps 20M] [--modes advisory,prerouted]

Without --mlx-model/--pack it builds the largest test checkpoint (qwen3_moe_large).
--prerouter adds rows for the prerouted mode; --modes picks the routing modes run beside native. Every row shows the exact-mode
limit at its budget: max(compute, the bytes Belady's policy reads on native's own routing
over the read rate), the best step native routing allows. --adapter-path adds rows serving that LoRA adapter unmerged (native 100%, and every
prerouted row) and prints its decode cost: tok/s with it over tok/s without. --cold drops the model's files from the page cache before every run and reads experts
with O_DIRECT; --fio also measures the experts file with fio (random reads of one
record each, O_DIRECT) for a reference read rate. --read-bps caps every run's disk reads
(edgemoe.constrained) as on a Mac, where reads dominate decode.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from edgemoe.format.source import NO_ADAPTER
from edgemoe.options import StreamOptions
from plotting import pyplot

BUDGETS = [1.0, 0.5, 0.25, 0.10]
ADVISORY_BUDGETS = [0.25, 0.10]
HEAD_MODES = ["prerouted"]  # needs --prerouter


def drop_page_cache(folder: Path):
    for f in folder.glob("*"):
        if f.suffix in (".bin", ".safetensors"):
            fd = os.open(f, os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def machine_cpu_s():
    """(busy, steal) CPU seconds of the whole machine so far, all cores (Linux's /proc/stat;
    None elsewhere): busy less this process's own is what other processes took."""
    try:
        fields = [int(v) for v in open("/proc/stat").readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    tick = os.sysconf("SC_CLK_TCK")
    return (user + nice + system + irq + softirq) / tick, steal / tick


def cpu_during(wall_s: float, own_before, own_after, machine_before, machine_after) -> dict:
    """This process's CPU ms a second of the span, and the cores other processes (and the
    hypervisor: steal) took meanwhile: a run beside another busy process is not measuring
    this one alone (2 cores here: one busy neighbour takes half the machine)."""
    own = (own_after.user - own_before.user) + (own_after.system - own_before.system)
    out = {"cpu_cores": own / wall_s}
    if machine_before and machine_after:
        out["others_cores"] = max(machine_after[0] - machine_before[0] - own, 0.0) / wall_s
        out["steal_cores"] = (machine_after[1] - machine_before[1]) / wall_s
    return out


def worker(kind: str, path: str, prompt_len: int, decode: int, io: str,
           prerouter=None, text=None, temp=0.0, adapter=None, cache_policy="lfu",
           readers=2, trace=None, forced=False) -> dict:
    """Run one configuration in this process and return its measurements."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    from edgemoe import streaming_of
    from edgemoe.streaming.telemetry import page_cache_bytes, peak_rss_bytes

    if kind == "mlx-lm":
        from mlx_lm import load

        model, tokenizer = load(path)
    else:
        import edgemoe

        budget, routing, *lora = kind.split(":")
        heads = prerouter if routing in HEAD_MODES else None
        # (a row without +LoRA serves no adapter, not even the one the heads carry: the
        # twin's validation models routing alone)
        options = StreamOptions(float(budget), cache_policy, io, routing, prerouter_path=heads,
                                adapter_path=adapter if lora else NO_ADAPTER, readers=readers)
        model, tokenizer = edgemoe.load(path, options)
    streaming = streaming_of(model)  # None: mlx-lm's own model
    store = streaming.store if streaming is not None else None
    if text:  # real text: routing as in use, not as on random tokens
        ids = tokenizer.encode(Path(text).read_text())
        prompt = mx.array(ids[:prompt_len])
    else:
        prompt = mx.array(np.random.default_rng(0).integers(3, 500, prompt_len))
    mx.random.seed(0)
    sampler = make_sampler(temp, 0.9)
    if forced:  # the text's own next tokens: every configuration decodes the same ones
        sampler = forced_sampler(ids[prompt_len:], decode, text)
    if trace and store:
        store.start_trace()
    steps = generate_step(prompt, model, max_tokens=decode, sampler=sampler)
    tic = time.perf_counter()
    next(steps)
    prompt_s = time.perf_counter() - tic
    before = store.snapshot() if store else None
    own, machine = os.times(), machine_cpu_s()
    tic = time.perf_counter()
    n = sum(1 for _ in steps)
    decode_s = time.perf_counter() - tic
    result = {
        "config": kind,
        "prompt_tps": prompt_len / prompt_s,
        "decode_tps": n / decode_s,
        **cpu_during(decode_s, own, os.times(), machine, machine_cpu_s()),
        "peak_mlx_bytes": mx.get_peak_memory(),
        "peak_rss_bytes": peak_rss_bytes(),
        "page_cache_bytes": sum(page_cache_bytes(f) for f in Path(path).glob("*")
                                if f.suffix in (".bin", ".safetensors")),  # resident too
    }
    if store:
        d = store.snapshot() - before
        result |= {
            "slots_per_layer": store.info().slots_per_layer,
            "expert_bytes_read_per_token": d.bytes_read / n,
            "blocked_ms_per_token": 1000 * d.blocked_s / n,
            "hit_rate": d.hit_rate,
            "read_gbps": d.read_gbps,
            "prefetch_precision": d.precision,
            "prefetch_recall": d.recall,
            "late_fills_per_token": d.late_fills / n,
            "prefetch_wasted_bytes_per_token": d.prefetch_wasted_bytes / n,
            "prefetch_cancelled_per_token": d.prefetch_cancelled / n,
            "host_syncs_per_token": d.host_syncs / n,
            "on_demand_per_token": d.on_demand / n,
            "io": store.info().io,
        }
        if trace:
            store.trace.save(trace)
    return result


def forced_sampler(following, decode: int, text):
    """A sampler that picks the text's next tokens, whatever the logits: decoding sees the
    same tokens in every configuration, so their routing differs only by what the
    configuration changes (sampled text diverges, and its routing with it)."""
    import mlx.core as mx

    following = list(following[:decode + 1])  # generate_step samples one step ahead
    if len(following) < decode + 1:
        raise SystemExit(f"{text}: --forced needs {decode + 1} tokens after the prompt, "
                         f"found {len(following)}")
    tokens = iter(following)
    return lambda logprobs: mx.array([next(tokens)] * logprobs.shape[0])


def run_config(kind, path, args) -> dict:
    if args.cold:
        drop_page_cache(Path(path))
    cmd = [sys.executable, __file__, "--worker", kind, "--path", str(path),
           "--prompt-len", str(args.prompt_len), "--decode", str(args.decode),
           "--io", "direct" if args.cold else "buffered"]
    if args.prerouter_path:
        cmd += ["--prerouter", args.prerouter_path]
    if args.text:
        cmd += ["--text", args.text]
    if args.adapter_path:
        cmd += ["--adapter-path", args.adapter_path]
    cmd += ["--temp", str(args.temp), "--cache-policy", args.cache_policy,
            "--readers", str(args.readers)] + (["--forced"] if args.forced else [])
    trace = None
    if kind.endswith(":native"):  # its routing, for the exact-mode limit
        trace = Path(args.out) / "traces" / f"{kind.split(':')[0]}.npz"
        trace.parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--trace", str(trace)]
    if args.read_bps:
        cmd = [sys.executable, "-m", "edgemoe.constrained", "--read-bps", args.read_bps,
               "--disk-of", str(path), "--"] + cmd
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    if trace:
        result["belady_bytes_per_token"] = belady_bytes(trace, float(kind.split(":")[0]))
    return result


def belady_bytes(trace: Path, budget: float) -> float:
    """Expert bytes per decoded token that Belady's policy (which knows the future) reads
    on this run's own routing at this budget: the fewest any exact mode can read."""
    import numpy as np

    from edgemoe.whatif.replay import simulate

    r = simulate(dict(np.load(trace)), budget, "belady")
    return r.decode_bytes_read / max(r.decode_tokens, 1)


def add_limits(rows: list, runs: dict, read_bps):
    """The exact-mode limit beside each row: the best step native routing allows at its
    budget, max(compute, Belady's bytes / read rate). Compute is native's step less the
    time it was blocked on reads; the read rate is the cap (unthrottled: the disk's rate
    while reading, as native measured it)."""
    for row in rows:
        budget = row.get("budget")
        native = runs.get(f"{budget}:native")
        if not native:
            continue
        compute_ms = statistics.median(1000 / r["decode_tps"] - r["blocked_ms_per_token"]
                                       for r in native)
        rate = parse_bps(read_bps) if read_bps else \
            statistics.median(r["read_gbps"] for r in native) * 1e9
        belady = statistics.median(r["belady_bytes_per_token"] for r in native)
        read_ms = 1000 * belady / rate if rate else 0.0
        row["limit_tps"] = 1000 / max(compute_ms, read_ms)
        row["limit_bound"] = "reads" if read_ms > compute_ms else "compute"
        row["of_limit"] = row["decode_tps"] / row["limit_tps"]
        row["belady_bytes_per_token"] = belady


def parse_bps(text: str) -> float:
    """'20M' -> 20 MiB/s, as the cap (numfmt --from=iec) reads it."""
    units = {"K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30}
    return float(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units \
        else float(text)


def lora_pairs(kinds) -> list:
    """The configurations also run with the adapter: native at 100% and every prerouted one,
    where they run without it (the decode cost is the ratio of the two)."""
    return [k for k in kinds if k == "1.0:native" or k.endswith(":prerouted")]


def default_model(out: Path):
    sys.path.insert(0, str(Path(__file__).parent))
    import make_test_checkpoints

    from edgemoe.convert import convert

    hf, mlx = make_test_checkpoints.make_all(out / "checkpoints", ["qwen3_moe_large"])["qwen3_moe_large"]
    pack = out / "packs" / "qwen3_moe_large"
    if not pack.exists():
        convert(hf, pack)
    return mlx, pack


def fio_read_rate(pack: Path) -> dict:
    """fio's random-read rate of the experts file with one record per read."""
    from edgemoe.format.pack import Pack

    p = Pack.open(pack)
    bs = max(4096, (p.layers[0].expert_bytes + 4095) // 4096 * 4096)
    rates = {}
    for depth in (1, 8):
        out = subprocess.run(
            ["fio", "--name=experts", f"--filename={p.experts_path}", "--readonly",
             "--rw=randread", f"--bs={bs}", "--direct=1", "--ioengine=psync",
             f"--numjobs={depth}", "--group_reporting", "--time_based", "--runtime=5",
             "--output-format=json"], check=True, capture_output=True, text=True).stdout
        job = json.loads(out)["jobs"][0]["read"]
        rates[f"qd{depth}_gbps"] = job["bw_bytes"] / 1e9
    return {"record_bytes": bs, **rates}


def summarize(runs: dict) -> list:
    """Medians over rounds; `decode_ratio` against mlx-lm resident (when it ran) and
    `vs_native` against native routing at the same budget, round by round."""
    base = statistics.median(r["decode_tps"] for r in runs["mlx-lm"]) if "mlx-lm" in runs \
        else None
    rows = []
    for kind, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]
               if isinstance(rs[0][k], (int, float))}
        if kind == "mlx-lm":
            med["config"] = "mlx-lm resident"
        else:
            budget, routing, *lora = kind.split(":")
            med["config"] = f"{routing} {float(budget):.0%}" + (" +LoRA" if lora else "")
            med["budget"], med["routing"] = budget, routing
            native = runs.get(f"{budget}:native")
            if native:
                med["vs_native"] = statistics.median(
                    r["decode_tps"] / n["decode_tps"] for r, n in zip(rs, native))
        for key in ("io",):
            if key in rs[0]:
                med[key] = rs[0][key]
        med["decode_ratio"] = med["decode_tps"] / base if base else med.get("vs_native", 1.0)
        rows.append(med)
    return rows


def print_table(rows):
    print(f"{'config':18} {'decode tok/s':>12} {'ratio':>6} {'vs native':>9} {'prompt tok/s':>12} "
          f"{'peak MLX MB':>11} {'peak RSS MB':>11} {'pg cache MB':>11} "
          f"{'KB read/tok':>11} {'blocked ms/tok':>14} {'hit rate':>8} {'read GB/s':>9} "
          f"{'precision':>9} {'recall':>6} {'syncs/tok':>9} {'limit tok/s':>11} {'of limit':>8}")
    for r in rows:
        limit = (f"{r['limit_tps']:6.1f} ({r['limit_bound'][0]})" if "limit_tps" in r
                 else "")
        print(f"{r['config']:18} {r['decode_tps']:12.1f} {r['decode_ratio']:6.2f} "
              f"{r.get('vs_native', 1.0):9.2f} "
              f"{r['prompt_tps']:12.1f} {r['peak_mlx_bytes'] / 1e6:11.1f} "
              f"{r['peak_rss_bytes'] / 1e6:11.1f} {r['page_cache_bytes'] / 1e6:11.1f} "
              f"{r.get('expert_bytes_read_per_token', 0) / 1e3:11.1f} "
              f"{r.get('blocked_ms_per_token', 0):14.2f} {r.get('hit_rate', 1):8.1%} "
              f"{r.get('read_gbps', 0):9.2f} {r.get('prefetch_precision', 0):9.1%} "
              f"{r.get('prefetch_recall', 0):6.1%} {r.get('host_syncs_per_token', 0):9.1f} "
              f"{limit:>11} {r.get('of_limit', 0):8.2f}")
    print("limit: the exact-mode best step at that budget, max(compute, Belady's bytes / read "
          "rate); (r) reads or (c) compute bound it")


def plot(rows, png: Path):
    plt = pyplot()

    names = [r["config"] for r in rows]
    fig, axes = plt.subplots(1, 4, figsize=(19, 4.8))
    for ax, key, title, scale, mark in (
        (axes[0], "decode_tps", "decode tok/s (tick: exact-mode limit)", 1, "limit_tps"),
        (axes[1], "expert_bytes_read_per_token", "expert KB read per token (tick: Belady)",
         1e-3, "belady_bytes_per_token"),
        (axes[2], "blocked_ms_per_token", "ms blocked on expert loads per token", 1, None),
        (axes[3], "peak_mlx_bytes", "peak MLX memory (MB)", 1e-6, None),
    ):
        ax.bar(names, [r.get(key, 0) * scale for r in rows], color="tab:blue")
        if mark:
            marked = [(i, r[mark] * scale) for i, r in enumerate(rows) if mark in r]
            ax.scatter([i for i, _ in marked], [v for _, v in marked], marker="_", s=400,
                       color="black", zorder=3)
        ax.set_title(title, fontsize=10)
        ax.tick_params(axis="x", rotation=45, labelsize=8)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mlx-model", help="mlx-lm int4 checkpoint (the resident baseline)")
    p.add_argument("--pack", help="the edgemoe pack of the same model")
    p.add_argument("--out", default="bench_out")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--cold", action="store_true",
                   help="Drop the page cache before each run; O_DIRECT expert reads")
    p.add_argument("--fio", action="store_true", help="Also measure the experts file with fio")
    p.add_argument("--budgets", default=None,
                   help="Budgets to run, e.g. 0.25,0.10 (default: 1.0,0.5,0.25,0.10)")
    p.add_argument("--read-bps", default=None,
                   help="Cap each run's disk reads at this rate (e.g. 20M), as on a Mac")
    p.add_argument("--text", default=None,
                   help="Take the prompt from this text file (default: random tokens)")
    p.add_argument("--modes", default=None,
                   help="Routing modes beside native, e.g. advisory,prerouted (default: "
                        "advisory, and with --prerouter prerouted)")
    p.add_argument("--temp", type=float, default=0.0,
                   help="Sampling temperature (top-p 0.9, seed 0); greedy by default")
    p.add_argument("--forced", action="store_true",
                   help="Decode the --text's own next tokens, not sampled ones: every "
                        "configuration sees the same tokens (as for an adapter's cost)")
    # --prerouter adds prerouted rows; --adapter-path adds rows serving
    # the adapter unmerged, and its decode cost
    StreamOptions.add_arguments(p, only=["prerouter_path", "adapter_path", "cache_policy", "readers"])
    p.add_argument("--io", default="buffered", help=argparse.SUPPRESS)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--trace", help=argparse.SUPPRESS)
    p.add_argument("--path", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.path, args.prompt_len, args.decode, args.io,
                                args.prerouter_path, args.text, args.temp, args.adapter_path,
                                args.cache_policy, args.readers, args.trace, args.forced)))
        return

    if args.forced and not args.text:
        p.error("--forced decodes the text's own tokens: give --text")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.pack:  # without --mlx-model, no resident baseline: ratios are to native
        mlx, pack = (Path(args.mlx_model) if args.mlx_model else None), Path(args.pack)
    else:
        mlx, pack = default_model(out)
    budgets = [float(b) for b in args.budgets.split(",")] if args.budgets else BUDGETS
    advisory_budgets = [b for b in budgets if b in ADVISORY_BUDGETS] or budgets
    modes = args.modes.split(",") if args.modes else \
        ["advisory"] + (HEAD_MODES if args.prerouter_path else [])
    unknown = set(modes) - {"advisory", *HEAD_MODES}
    if unknown or (set(modes) & set(HEAD_MODES) and not args.prerouter_path):
        p.error(f"--modes: choose from advisory, {', '.join(HEAD_MODES)} (the last "
                f"needs --prerouter); got {args.modes}")
    configs = ([("mlx-lm", mlx)] if mlx else []) + [(f"{b}:native", pack) for b in budgets]
    configs += [(f"{b}:{mode}", pack) for mode in modes for b in advisory_budgets]
    lora = lora_pairs([kind for kind, _ in configs]) if args.adapter_path else []
    configs += [(f"{kind}:lora", pack) for kind in lora]
    runs = {kind: [] for kind, _ in configs}
    for r in range(args.rounds):
        for kind, path in configs:  # alternate: every round runs every configuration
            runs[kind].append(run_config(kind, path, args))
            print(f"round {r + 1}/{args.rounds} {kind}: "
                  f"{runs[kind][-1]['decode_tps']:.1f} tok/s", file=sys.stderr)
    rows = summarize(runs)
    add_limits(rows, runs, args.read_bps)
    print_table(rows)
    result = {"mlx_model": str(mlx) if mlx else None, "pack": str(pack), "rounds": args.rounds,
              "prompt_len": args.prompt_len, "decode_tokens": args.decode,
              "cold": args.cold, "text": args.text, "temp": args.temp, "forced": args.forced,
              "read_bps": args.read_bps,
              "summary": rows, "runs": runs}
    if args.adapter_path:
        result["lora_decode_cost"] = {
            kind: statistics.median(a["decode_tps"] / b["decode_tps"] for a, b in
                                    zip(runs[f"{kind}:lora"], runs[kind]))
            for kind in lora}
        for kind, ratio in result["lora_decode_cost"].items():
            print(f"unmerged LoRA at {kind}: decode tok/s ratio with/without {ratio:.3f} "
                  f"(median over rounds)")
    if args.fio:
        result["fio"] = fio_read_rate(pack)
        print(f"fio, random {result['fio']['record_bytes'] / 1e3:.0f} KB reads of "
              f"experts.bin, O_DIRECT: QD1 {result['fio']['qd1_gbps']:.2f} GB/s, "
              f"QD8 {result['fio']['qd8_gbps']:.2f} GB/s")
    (out / "bench_stream.json").write_text(json.dumps(result, indent=1))
    plot(rows, out / "bench_stream.png")
    print(f"wrote {out / 'bench_stream.json'} and {out / 'bench_stream.png'}")


if __name__ == "__main__":
    main()
