"""The decode hot path against mlx-lm's, in one process: evaluations per token, main-thread
CPU per MoE layer, tok/s (issue #50).

    python scripts/bench_hotpath.py [--model edgemoe/models/fine] [--budgets 100%,50%,25%]
           [--routing native,prerouted] [--tokens 48] [--rounds 5] [--out DIR]
           [--sync-floor] [--minimal 50%]

Every configuration decodes the same prompt greedily with mlx-lm's own loop
(`mlx_lm.generate.generate_step`), mlx-lm's model first and each edgemoe budget after it, in
an order that rotates every round; medians over the rounds. Each model is loaded once and
warmed by a first run (the page cache holds the experts: "warm"; an edgemoe store keeps its
slots between rounds, as a server does between requests).

- evaluations per token: every `mx.eval` and `mx.async_eval` during decode (both are
  patched here; edgemoe's own host syncs go through edgemoe.mlx_backend.hostsync, which calls
  them), over the tokens decoded. mlx-lm's loop is one a token (`async_eval` of the next
  token; `.item()` then waits on that same evaluation).
- main-thread CPU: `time.thread_time()` of the decoding thread over the same span; MLX
  computes on its own threads, so this is the host's work (Python, graph building, waits
  that spin). Reported per MoE layer as edgemoe's minus mlx-lm's, paired round by round:
  the median, the quartiles (the rounds' spread) and a 95% bootstrap interval of the median
  (its own uncertainty: how far a run can place the median, beside a bar).
- tok/s over the same span; tokens are checked against mlx-lm's (exact modes).
- graph build: main-thread CPU to build a decode step's graph, never evaluated
  (`graph_build_us`): the host's cost alone where the step has no host sync (a resident
  model), which the machine's other work hardly moves, unlike the two figures above.

`--sync-floor` adds a row of mlx-lm's own model whose expert modules read their routing
back first (an evaluation and the ids on the host, as a streamer with one routing sync per
MoE layer must): the host cost of the sync alone, the floor of any such path on this
machine, beside edgemoe's; the main-thread CPU of one blocking hand-off between two
threads (a wait woken by another thread: what a miss read by a reader thread costs the
decoding thread here, whatever the code around it); and that of a 2 KB allocation right
after each routing sync, in both (glibc's bill for what the evaluation freed, which the first
such allocation pays, wherever it is: docs/benchmarks.md, session 36).

`--minimal BUDGET` adds the minimal streamer (scripts/minimal_streamer.py): mlx-lm's model
streaming its experts through as many slots as edgemoe's at BUDGET, with one routing sync a
layer, an LRU dict and one reader thread, and none of edgemoe's bookkeeping: the least such a
streamer costs the host here, and edgemoe's figure over it, paired round by round.

`--host-only` times the host's side of the calls alone (`host_path`: the slot state machine,
the reader hand-off, no model), main-thread CPU per call at each budget: a figure that MLX's
own work cannot blur.

`--io direct` reads every miss from the disk (O_DIRECT): "cold"; the default reads through
the page cache, which holds the experts after the first run: "warm".

Writes DIR/bench_hotpath.json and DIR/bench_hotpath.png. A model given as an mlx-lm
checkpoint folder (e.g. scripts/make_large_checkpoint.py's) is read in place; a pack (the
bundled model) is unpacked to an mlx-lm checkpoint for mlx-lm first.
"""

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.format.source import BUNDLED_MODEL
from edgemoe.mlx_backend.experts import streaming_of
from edgemoe.mlx_backend.hostsync import QueuedReads

sys.path.insert(0, str(Path(__file__).resolve().parent))
from minimal_streamer import install as install_minimal  # noqa: E402
from plotting import pyplot  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class EvalCounter:
    """Counts `mx.eval` and `mx.async_eval` calls while installed (a context manager)."""

    def __init__(self):
        self.count = 0

    @contextlib.contextmanager
    def installed(self):
        real_eval, real_async = mx.eval, mx.async_eval

        def counted_eval(*args, **kwargs):
            self.count += 1
            return real_eval(*args, **kwargs)

        def counted_async(*args, **kwargs):
            self.count += 1
            return real_async(*args, **kwargs)

        mx.eval, mx.async_eval = counted_eval, counted_async
        try:
            yield self
        finally:
            mx.eval, mx.async_eval = real_eval, real_async


def decode(model, prompt: mx.array, tokens: int, counter: EvalCounter) -> dict:
    """Greedy decode by mlx-lm's loop; figures over the tokens after the first (the first
    carries the prefill). For an edgemoe model, also its misses (experts read) per decode
    call of a MoE layer over the same span: the forward of each token after the first (mlx-lm
    builds a token's forward before it yields the one before)."""
    store = model.expert_store if streaming_of(model) is not None else None
    out, start, before = [], None, None
    for token, _ in generate_step(prompt, model, max_tokens=tokens):
        out.append(token)
        if start is None:
            before = store.snapshot() if store is not None else None
            start = time.perf_counter(), time.thread_time(), counter.count
    wall, cpu, evals = (time.perf_counter() - start[0], time.thread_time() - start[1],
                        counter.count - start[2])
    n = len(out) - 1
    result = {"tokens": out, "tok_s": n / wall, "cpu_us_per_token": 1e6 * cpu / n,
              "evals_per_token": evals / n}
    if store is not None:
        loads = (store.snapshot() - before).loads
        result["misses_per_call"] = loads / max(1, n * len(store.layer_indices))
    return result


@contextlib.contextmanager
def routing_sync(on: bool, after: Optional[Callable[[], None]] = None):
    """While on, mlx-lm's expert modules read their routing back before computing: one
    evaluation and the ids on the host per MoE layer (`--sync-floor`); then `after()`, if
    given."""
    if not on:
        yield
        return
    from mlx_lm.models import switch_layers

    originals = {cls: cls.__call__ for cls in (switch_layers.SwitchGLU, switch_layers.SwitchMLP)}

    def synced(call):
        def __call__(self, x, indices):
            mx.eval(indices)
            indices.tolist()
            if after is not None:
                after()
            return call(self, x, indices)
        return __call__

    for cls, call in originals.items():
        cls.__call__ = synced(call)
    try:
        yield
    finally:
        for cls, call in originals.items():
            cls.__call__ = call


def allocation_after_sync_us(models: dict, prompt: mx.array, tokens: int,
                             counter: EvalCounter) -> dict:
    """Main-thread CPU of a 2 KB allocation right after each routing sync (us, median over
    one decode), for each model that syncs: mlx-lm's with the sync floor, and edgemoe's
    (after `QueuedReads.sync`). The first allocation of 1 KB or more after an evaluation
    pays for glibc's sorting of what the evaluation freed: whatever code allocates first
    pays it, once a sync (docs/benchmarks.md, session 36)."""
    times = {}

    def allocate(into: list):
        start = time.thread_time()
        bytearray(2048)
        into.append(1e6 * (time.thread_time() - start))

    sync = QueuedReads.sync
    for name, model in models.items():
        into = times[name] = []
        if name == "mlx-lm + routing sync":
            with routing_sync(True, after=lambda: allocate(into)):
                decode(model, prompt, tokens, counter)
        elif streaming_of(model) is not None:
            QueuedReads.sync = lambda self, *arrays: (sync(self, *arrays), allocate(into))[0]
            try:
                decode(model, prompt, tokens, counter)
            finally:
                QueuedReads.sync = sync
    return {name: statistics.median(t) for name, t in times.items() if t}


def handoff_cpu_us(reps: int = 400) -> float:
    """Main-thread CPU of one blocking wait that another thread ends (~300 us later), us
    (median): the sleep and the wake-up, with nothing else in it."""
    import threading

    times = []
    for _ in range(reps):
        latch = threading.Lock()
        latch.acquire()
        waker = threading.Timer(0.0003, latch.release)
        waker.start()
        start = time.thread_time()
        latch.acquire()
        times.append(time.thread_time() - start)
        waker.join()
    return 1e6 * statistics.median(times)


def graph_build_us(model, prompt: mx.array, reps: int) -> float:
    """Main-thread CPU to build one decode step's graph, us (median of `reps`): the step is
    called and never evaluated, its KV cache trimmed back after each. The host's own cost
    alone, with no wait on the device in it where the step has no host sync (a resident
    model): a figure that other work on the machine hardly moves."""
    cache = make_prompt_cache(model)
    mx.eval(model(prompt[None], cache=cache))
    token = prompt[-1:][None]
    times = []
    for i in range(reps):
        start = time.thread_time()
        model(token, cache=cache)
        times.append(time.thread_time() - start)
        for c in cache:
            c.trim(1)
        if i % 8 == 7:  # cut the chain of lazy cache updates (not timed)
            mx.eval([c.state for c in cache])
    return 1e6 * statistics.median(times)


def mlx_lm_folder(model: Path, scratch: Path) -> Path:
    """An mlx-lm checkpoint of `model`: itself, or a pack unpacked."""
    if not (model / "manifest.json").exists():
        return model
    sys.path.insert(0, str(ROOT / "tests"))
    from unpack import unpack

    return unpack(model, scratch / "mlx")


def misses_and_calls(streamers: list) -> tuple:
    """The minimal streamers' misses and decode calls so far (`--minimal`)."""
    return sum(s.misses for s in streamers), sum(s.calls for s in streamers)


def moe_layers(model) -> int:
    return len(model.expert_store.layer_indices)


def median_interval(values: list, resamples: int = 2000, seed: int = 0) -> list:
    """A 95% bootstrap interval of the median of `values` (paired rounds): how far the
    median itself may be off, which the quartiles (the rounds' spread) do not say."""
    if len(values) < 2:
        return quartiles(values)
    pick = random.Random(seed).choices
    medians = sorted(statistics.median(pick(values, k=len(values))) for _ in range(resamples))
    return [medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]]


def quartiles(values: list) -> list:
    """The first and third quartiles of `values` (both the value itself when one)."""
    if len(values) < 2:
        return [values[0], values[0]] if values else [None, None]
    q = statistics.quantiles(values, n=4)
    return [q[0], q[2]]


def run(args) -> dict:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench_hotpath-") as scratch:  # (loaded whole)
        folder = mlx_lm_folder(args.model, Path(scratch))
        reference, tokenizer = mlx_lm_load(str(folder))
        minimal = mlx_lm_load(str(folder))[0] if args.minimal else None
    text = (ROOT / "README.md").read_text()
    prompt = mx.array(tokenizer.encode(text)[:args.prompt])
    models = {"mlx-lm": reference}
    if args.sync_floor:  # (the same model, its routing read back at every MoE layer)
        models["mlx-lm + routing sync"] = reference
    for routing in args.routing:
        for budget in args.budgets:
            name = budget if routing == "native" else f"{budget} {routing}"
            models[name], _ = edgemoe.load(args.model, expert_budget=budget, routing=routing,
                                           io=args.io)
    streamers = []
    if minimal is not None:  # (as many slots as edgemoe's at that budget)
        if args.minimal not in models:
            raise SystemExit(f"--minimal {args.minimal}: not among the native budgets "
                             f"({','.join(args.budgets)})")
        store = models[args.minimal].expert_store
        streamers = install_minimal(minimal, store.pool(store.layer_indices[0]).num_slots)
        models[f"minimal {args.minimal}"] = minimal
    layers = moe_layers(next(m for m in models.values() if streaming_of(m) is not None))
    counter = EvalCounter()
    runs = {name: [] for name in models}
    with counter.installed():
        for name, model in models.items():  # warm: page cache, slots, compiled kernels
            with routing_sync(name == "mlx-lm + routing sync"):
                decode(model, prompt, args.tokens, counter)
        names = list(models)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                with routing_sync(name == "mlx-lm + routing sync"):
                    before = misses_and_calls(streamers) if models[name] is minimal else None
                    runs[name].append(decode(models[name], prompt, args.tokens, counter))
                    if before is not None:  # (the decode's calls alone: not the builds')
                        after = misses_and_calls(streamers)
                        runs[name][-1]["misses_per_call"] = \
                            (after[0] - before[0]) / max(1, after[1] - before[1])
                    runs[name][-1]["build_us"] = graph_build_us(models[name], prompt,
                                                                args.builds)
                print(f"round {r} {name}: {runs[name][-1]['tok_s']:.1f} tok/s, "
                      f"{runs[name][-1]['evals_per_token']:.2f} evals/token, "
                      f"{runs[name][-1]['build_us']:.0f} us a step's graph", flush=True)
    expected = runs["mlx-lm"][0]["tokens"]
    base = {k: statistics.median(x[k] for x in runs["mlx-lm"])
            for k in ("tok_s", "cpu_us_per_token")}
    rows = []
    for name, results in runs.items():
        med = {k: statistics.median(x[k] for x in results)
               for k in ("tok_s", "cpu_us_per_token", "evals_per_token")}
        ratios = [x["tok_s"] / y["tok_s"] for x, y in zip(results, runs["mlx-lm"])]
        over = [(x["cpu_us_per_token"] - y["cpu_us_per_token"]) / layers
                for x, y in zip(results, runs["mlx-lm"])]
        build_over = [(x["build_us"] - y["build_us"]) / layers
                      for x, y in zip(results, runs["mlx-lm"])]
        rows.append({
            "config": name, **med,
            "evals_per_moe_layer": med["evals_per_token"] / layers,
            "tok_s_vs_mlx_lm": statistics.median(ratios),
            "cpu_over_mlx_lm_us_per_moe_layer": statistics.median(over),
            # the spread of the paired rounds (quartiles): run-to-run noise on these VMs
            # is of the order of the differences measured
            "cpu_over_mlx_lm_quartiles": quartiles(over),
            "cpu_over_mlx_lm_median_95": median_interval(over),
            "cpu_over_mlx_lm_per_round": over,
            # building a step's graph (with its host syncs, where it has any)
            "build_over_mlx_lm_us_per_moe_layer": statistics.median(build_over),
            # experts read per decode call of a MoE layer (streamers: edgemoe, the minimal)
            "misses_per_decode_call": statistics.median(x["misses_per_call"] for x in results)
            if "misses_per_call" in results[0] else None,
            "same_tokens_as_mlx_lm": all(x["tokens"] == expected for x in results)
            if "prerouted" not in name else None,  # (prerouted is not exact)
        })
    allocation = allocation_after_sync_us(models, prompt, args.tokens, counter) \
        if args.sync_floor else None
    over_minimal = None
    if minimal is not None:  # edgemoe over the yardstick, round by round
        paired = [(x["cpu_us_per_token"] - y["cpu_us_per_token"]) / layers
                  for x, y in zip(runs[args.minimal], runs[f"minimal {args.minimal}"])]
        over_minimal = {"budget": args.minimal, "us_per_moe_layer": statistics.median(paired),
                        "quartiles": quartiles(paired),
                        "median_95": median_interval(paired),
                        "minimal_misses_per_call": statistics.median(
                            x["misses_per_call"] for x in runs[f"minimal {args.minimal}"]),
                        "edgemoe_misses_per_call": statistics.median(
                            x["misses_per_call"] for x in runs[args.minimal])}
    for name, model in models.items():
        if streaming_of(model) is not None:
            model.expert_store.close()
    return {"model": str(args.model), "moe_layers": layers, "prompt_tokens": args.prompt,
            "decode_tokens": args.tokens - 1, "rounds": args.rounds,
            "io": args.io, "mlx_lm": base, "rows": rows,
            # one blocking hand-off between threads, main-thread CPU (`--sync-floor`)
            "handoff_cpu_us": handoff_cpu_us() if args.sync_floor else None,
            # a 2 KB allocation right after each routing sync (`--sync-floor`)
            "allocation_after_sync_us": allocation,
            # edgemoe's main-thread CPU over the minimal streamer's at its budget (`--minimal`)
            "over_minimal": over_minimal,
            # the machine's load average (1 min) at the start and the end: timings taken
            # beside other work are noisy; the evaluation counts are not
            "load_average": [load_before, os.getloadavg()[0]],
            "command": " ".join(sys.argv)}


def host_path(args) -> dict:
    """The host's side of decode calls alone, no MLX graph: a real store (MLX slot memory,
    reader threads, page cache warm after a first pass) driven by a shipped trace's decoded
    tokens, one call per MoE layer as the streaming module makes it (the previous layer's
    held slots released, then `run_call` holding its own). Main-thread CPU per call, us,
    for each budget; the same hits and loads whatever the code's speed."""
    from edgemoe.format.pack import Pack
    from edgemoe.mlx_backend.slots import MLXSlotMemory
    from edgemoe.streaming.calls import run_call
    from edgemoe.streaming.store import ExpertStore

    pack = Pack.open(args.model)
    trace = np.load(args.model / "traces" / "docs.npz")
    routed = trace["routed"][trace["decode"]][:args.host_tokens]
    rows = []
    for budget in args.budgets:
        store = ExpertStore(pack, budget, memory=MLXSlotMemory)
        pools = [store.pool(i) for i in store.layer_indices]

        def decode_trace():
            held = None
            for token in routed:
                for pool, ids in zip(pools, token):
                    if held is not None:
                        held.release()
                    run_call(pool, np.array(ids.reshape(1, 1, -1)),
                             lambda rows, slot_ids: slot_ids.astype(np.uint32), hold=True)
                    held = pool
            held.release()

        decode_trace()  # warm
        before, start = store.snapshot(), time.thread_time()
        decode_trace()
        cpu, stats = time.thread_time() - start, store.snapshot() - before
        calls = len(routed) * len(pools)
        rows.append({"budget": budget, "us_per_call": 1e6 * cpu / calls,
                     "misses_per_call": stats.loads / calls, "hits": stats.hits,
                     "loads": stats.loads})
        store.close()
    store = ExpertStore(pack, args.budgets[0], memory=MLXSlotMemory)
    after = after_evaluation_us(store.pool(store.layer_indices[0]), pack.top_k)
    store.close()
    return {"model": str(args.model), "tokens": len(routed), "rows": rows,
            "all_hit_call_after_evaluation_us": after,
            "load_average": os.getloadavg()[0], "command": " ".join(sys.argv)}


def after_evaluation_us(pool, k: int, reps: int = 300) -> dict:
    """Main-thread CPU of one all-hit call's claim and release (k experts, us, median)
    right after: nothing, a 2 ms sleep, 2 ms of a Python loop, an evaluation of nothing to
    compute, and one of a decode-sized graph (50 small matmuls, ~2 ms here). The decode
    path's host work follows a routing sync: the sleep and the loop say what any 2 ms away
    costs, the graph what an evaluation's own host work (its dispatch of each op) adds."""
    wanted = list(range(k))
    pool.ensure(np.array(wanted))
    pool.release()
    small, x, a = mx.ones((4,)), mx.random.normal((1, 256)), mx.random.normal((256, 256))
    mx.eval(x, a)

    def graph():
        y = x
        for _ in range(50):
            y = mx.tanh(y @ a)
        mx.eval(y)

    def loop(seconds=0.002):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    before = {"none": lambda: None, "sleep": lambda: time.sleep(0.002), "loop": loop,
              "trivial": lambda: mx.eval(small + 1), "graph": graph}
    times = {name: [] for name in before}
    for _ in range(reps):  # (alternating: the machine's state is the same for each)
        for name, evaluate in before.items():
            evaluate()
            start = time.thread_time()
            pool.claim(wanted)
            pool.release()
            times[name].append(time.thread_time() - start)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def plot(result: dict, png: Path, before: dict = None):
    plt = pyplot()

    runs = [("after" if before else "", result)] + ([("before", before)] if before else [])
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    metrics = [("evals_per_token", "evaluations per decoded token"),
               ("cpu_over_mlx_lm_us_per_moe_layer", "main-thread CPU over mlx-lm, us / MoE layer"),
               ("tok_s_vs_mlx_lm", "tok/s, x mlx-lm's")]
    configs = [r["config"] for r in result["rows"]]
    width = 0.8 / len(runs)
    for ax, (key, title) in zip(axes, metrics):
        for i, (label, res) in enumerate(runs):
            by = {r["config"]: r[key] for r in res["rows"]}
            xs = [j + i * width for j in range(len(configs))]
            ax.bar(xs, [by.get(c, 0) for c in configs], width, label=label or None)
        ax.set_xticks([j + width * (len(runs) - 1) / 2 for j in range(len(configs))])
        ax.set_xticklabels(configs, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=9)
        if before:
            ax.legend(fontsize=8)
    temperature = "cold" if result.get("io") == "direct" else "warm"
    fig.suptitle(f"decode hot path: {Path(result['model']).name}, {result['moe_layers']} MoE "
                 f"layers, {result['decode_tokens']} tokens x {result['rounds']} rounds "
                 f"({temperature})",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--budgets", default="100%,50%,25%")
    p.add_argument("--routing", default="native", help="comma-separated: native,prerouted")
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--builds", type=int, default=40, help="graphs built per round (graph_build_us)")
    p.add_argument("--out", type=Path, default=Path("runs/bench_hotpath"))
    p.add_argument("--io", default="buffered", choices=("buffered", "direct"),
                   help="direct: every miss read from the disk (O_DIRECT: cold), not the "
                        "page cache (warm)")
    p.add_argument("--host-only", action="store_true",
                   help="the host's side of the calls alone (a pack with traces/docs.npz): "
                        "main-thread CPU per call, no model")
    p.add_argument("--host-tokens", type=int, default=400)
    p.add_argument("--sync-floor", action="store_true",
                   help="add mlx-lm's model with its routing read back at every MoE layer "
                        "(the host cost of the sync alone), one thread hand-off's CPU, and "
                        "a 2 KB allocation's right after each routing sync")
    p.add_argument("--minimal", metavar="BUDGET",
                   help="add the minimal streamer (scripts/minimal_streamer.py) with as many "
                        "slots as edgemoe's at BUDGET, one of --budgets: the least a streamer "
                        "with one routing sync a layer does on the host")
    p.add_argument("--before", type=Path, help="an earlier run's JSON, drawn beside this one")
    args = p.parse_args()
    args.budgets = args.budgets.split(",")
    args.routing = args.routing.split(",")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.host_only:
        result = host_path(args)
        (args.out / "host_path.json").write_text(json.dumps(result, indent=1))
        for r in result["rows"]:
            print(f"{r['budget']:>6}: {r['us_per_call']:6.1f} us a call, "
                  f"{r['misses_per_call']:.2f} misses a call, hits {r['hits']} loads {r['loads']}")
        print("an all-hit call's claim and release, right after: " + ", ".join(
            f"{k} {v:.1f} us" for k, v in result["all_hit_call_after_evaluation_us"].items()))
        return
    result = run(args)
    (args.out / "bench_hotpath.json").write_text(json.dumps(result, indent=1))
    print(f"{'config':>18} {'evals/tok':>9} {'evals/layer':>11} {'cpu+us/layer':>12} "
          f"{'(quartiles)':>15} {'(median 95%)':>13} {'build+us/layer':>14} {'tok/s':>7} "
          f"{'x mlx-lm':>8} same")
    for r in result["rows"]:
        print(f"{r['config']:>18} {r['evals_per_token']:9.2f} {r['evals_per_moe_layer']:11.2f} "
              f"{r['cpu_over_mlx_lm_us_per_moe_layer']:12.1f} "
              f"{'%.0f..%.0f' % tuple(r['cpu_over_mlx_lm_quartiles']):>15} "
              f"{'%.0f..%.0f' % tuple(r['cpu_over_mlx_lm_median_95']):>13} "
              f"{r['build_over_mlx_lm_us_per_moe_layer']:14.1f} {r['tok_s']:7.1f} "
              f"{r['tok_s_vs_mlx_lm']:8.3f} {r['same_tokens_as_mlx_lm']}")
    if result["handoff_cpu_us"] is not None:
        print(f"one blocking hand-off between threads: {result['handoff_cpu_us']:.1f} us of "
              f"the waiting thread's CPU")
        print("a 2 KB allocation right after a routing sync: " + ", ".join(
            f"{name} {us:.1f} us" for name, us in result["allocation_after_sync_us"].items()))
    if result["over_minimal"] is not None:
        m = result["over_minimal"]
        print(f"{m['budget']} over the minimal streamer, paired: {m['us_per_moe_layer']:.1f} "
              f"us a MoE layer (quartiles {'%.0f..%.0f' % tuple(m['quartiles'])}, median "
              f"95% {'%.0f..%.0f' % tuple(m['median_95'])}); misses a decode "
              f"call: the minimal's {m['minimal_misses_per_call']:.2f}, edgemoe's "
              f"{m['edgemoe_misses_per_call']:.2f}")
    before = json.loads(args.before.read_text()) if args.before else None
    plot(result, args.out / "bench_hotpath.png", before)  # (last: it may need matplotlib)


if __name__ == "__main__":
    main()
