"""Where a prefill's time goes (scripts/bench_prefill.py --profile): per-op timings of one
warm forward call over a prompt, for mlx-lm and for edgemoe at each budget with native and
BLAS arithmetic, in alternating rounds, medians."""

import json
import os
import statistics
import time
from collections import defaultdict
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from plotting import pyplot

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("attention projections", "attention (sdpa, rope, norms)", "routers", "expert matmuls",
         "waiting on reads", "streaming host work", "lm head", "other")


class Clock:
    """Seconds per part of one forward call; each timed op's inputs are evaluated before
    it starts and its output when it ends."""

    def __init__(self):
        self.seconds = defaultdict(float)

    def wrap(self, part, call):
        def timed(*args, **kwargs):
            mx.eval([a for a in args if isinstance(a, mx.array)])
            tic = time.perf_counter()
            out = call(*args, **kwargs)
            mx.eval(out)
            self.seconds[part] += time.perf_counter() - tic
            return out
        return timed

    def instrument(self, module, part):
        """Time every call of this module (its class's __call__, on this instance only)."""
        cls = type(module)
        wrapped = self.wrap(part, lambda *a, **k: cls.__call__(module, *a, **k))
        module.__class__ = type(cls.__name__, (cls,),
                                {"__call__": lambda self, *a, **k: wrapped(*a, **k)})


def instrumented(model) -> Clock:
    from edgemoe.mlx_backend.experts import StreamingExperts

    clock = Clock()
    if hasattr(model, "lm_head"):
        clock.instrument(model.lm_head, "lm head")
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            clock.instrument(getattr(attn, name), "attention projections")
        clock.instrument(attn, "attention")
        mlp = layer.mlp
        if hasattr(mlp, "gate"):
            clock.instrument(mlp.gate, "routers")
        experts = mlp.switch_mlp
        if isinstance(experts, StreamingExperts):
            experts.pool.module = _TimedPool(experts.pool.module, clock)
            clock.instrument(experts, "streaming")
        else:
            clock.instrument(experts, "expert matmuls")
    return clock


class _TimedPool:
    """A pool's expert module, its calls timed as the experts' matmuls."""

    def __init__(self, module, clock):
        self.module, self.call = module, clock.wrap("expert matmuls", module)

    def __call__(self, *args):
        return self.call(*args)

    def __getattr__(self, name):
        return getattr(self.module, name)

    def __getitem__(self, name):
        return self.module[name]


def one_prefill(model, clock, tokens) -> dict:
    store = getattr(model, "expert_store", None)
    before = store.snapshot() if store is not None else None
    clock.seconds.clear()
    tic = time.perf_counter()
    mx.eval(model(tokens, cache=make_prompt_cache(model)))  # (its own call: BLAS's flag)
    total = time.perf_counter() - tic
    t = dict(clock.seconds)
    parts = {"attention projections": t.get("attention projections", 0.0),
             "attention (sdpa, rope, norms)": t.get("attention", 0.0)
             - t.get("attention projections", 0.0),
             "routers": t.get("routers", 0.0), "expert matmuls": t.get("expert matmuls", 0.0),
             "lm head": t.get("lm head", 0.0)}
    if store is not None:
        reads = (store.snapshot() - before).blocked_s
        parts["waiting on reads"] = reads
        parts["streaming host work"] = t.get("streaming", 0.0) - t["expert matmuls"] - reads
    parts["other"] = max(0.0, total - sum(parts.values()))
    return {"total_s": total, "tok_per_s": tokens.size / total, "parts": parts}


def profile(args, budgets):
    import edgemoe
    from mlx_lm.utils import load as mlx_lm_load

    models = {}
    tokenizer = None
    if args.mlx_lm:
        models["mlx-lm"], tokenizer = mlx_lm_load(args.mlx_lm)
    for budget in budgets:
        for arithmetic in ("native", "blas"):
            models[f"edgemoe {budget:.0%} {arithmetic}"], tokenizer = edgemoe.load(
                args.model, expert_budget=budget, prefill_arithmetic=arithmetic)
    clocks = {name: instrumented(m) for name, m in models.items()}
    text = (ROOT / "edgemoe" / "streaming" / "slots.py").read_text() * 8
    tokens = mx.array(tokenizer.encode(text)[:args.prompt_len])[None]
    for name, m in models.items():  # warm: the first call reads a budget's experts
        one_prefill(m, clocks[name], tokens)
    runs = []
    names = list(models)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            row = one_prefill(models[name], clocks[name], tokens)
            runs.append({"config": name, "round": r, **row,
                         "loadavg": open("/proc/loadavg").read().split()[:3]})
            print(json.dumps(runs[-1]), flush=True)
    medians = {}
    for name in names:
        mine = [x for x in runs if x["config"] == name]
        medians[name] = {"total_s": statistics.median(x["total_s"] for x in mine),
                         "tok_per_s": statistics.median(x["tok_per_s"] for x in mine),
                         "parts": {p: statistics.median(x["parts"].get(p, 0.0) for x in mine)
                                   for p in PARTS}}
    print(f"\nprefill of {tokens.size} tokens (one forward call, warm), median of "
          f"{args.rounds}; seconds per part")
    print(f"{'part':32s}" + "".join(f"{n:>22s}" for n in names))
    for p in PARTS:
        print(f"{p:32s}" + "".join(f"{medians[n]['parts'][p]:22.2f}" for n in names))
    print(f"{'total':32s}" + "".join(f"{medians[n]['total_s']:22.2f}" for n in names))
    print(f"{'tok/s':32s}" + "".join(f"{medians[n]['tok_per_s']:22.1f}" for n in names))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(
        {"prompt_len": int(tokens.size), "model": _name(args.model), "runs": runs,
         "median": medians}, indent=1))
    _plot(medians, names, out / "profile.png", tokens.size)


def _plot(medians, names, path, prompt_len):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(names)
    for p in PARTS:
        values = [medians[n]["parts"][p] for n in names]
        ax.bar(names, values, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_ylabel(f"seconds to prefill {prompt_len} tokens")
    ax.tick_params(axis="x", labelrotation=20)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


LLAMA_CPP = """
import json, os, sys, time
import numpy as np
from llama_cpp import Llama
gguf, n = sys.argv[1], int(sys.argv[2])
llm = Llama(gguf, n_ctx=n + 16, n_batch=min(n, 2048), n_threads=os.cpu_count(), verbose=False)
prompt = np.random.default_rng(0).integers(10, llm.n_vocab() - 10, n).tolist()
tic = time.perf_counter()
llm.eval(prompt)
print(json.dumps({"ttft_s": time.perf_counter() - tic}))
"""

MLX = """
import json, sys, time
import numpy as np
import mlx.core as mx
from mlx_lm.generate import generate_step
which, path, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
if which == "mlx-lm":
    from mlx_lm import load
    model, tokenizer = load(path)
else:
    import edgemoe
    budget, arithmetic = which.split(":")
    model, tokenizer = edgemoe.load(path, expert_budget=float(budget),
                                    prefill_arithmetic=arithmetic)
prompt = mx.array(np.random.default_rng(0).integers(10, tokenizer.vocab_size - 10, n).tolist())
tic = time.perf_counter()
next(generate_step(prompt, model, max_tokens=1, prefill_step_size=2048))
print(json.dumps({"ttft_s": time.perf_counter() - tic}))
"""


def peers(args, budgets):
    import subprocess
    import sys

    configs = {}
    if args.gguf:
        configs["llama.cpp"] = [args.llama_python, "-c", LLAMA_CPP, args.gguf,
                                str(args.prompt_len)]
    if args.mlx_lm:
        configs["mlx-lm"] = [sys.executable, "-c", MLX, "mlx-lm", args.mlx_lm,
                             str(args.prompt_len)]
    for budget in budgets:
        for arithmetic in ("native", "blas"):
            configs[f"edgemoe {budget:.0%} {arithmetic}"] = [
                sys.executable, "-c", MLX, f"{budget}:{arithmetic}", args.model,
                str(args.prompt_len)]
    runs, names = [], list(configs)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            out = subprocess.run(configs[name], capture_output=True, text=True, check=True,
                                 env={**os.environ, "PYTHONPATH": str(ROOT)})
            row = json.loads(out.stdout.strip().splitlines()[-1])
            runs.append({"config": name, "round": r, **row,
                         "tok_per_s": args.prompt_len / row["ttft_s"],
                         "loadavg": open("/proc/loadavg").read().split()[:3]})
            print(json.dumps(runs[-1]), flush=True)
    medians = {n: statistics.median(x["ttft_s"] for x in runs if x["config"] == n)
               for n in names}
    print(f"\nTTFT of a {args.prompt_len}-token prompt, median of {args.rounds}")
    for n in names:
        print(f"{n:24s} {medians[n]:8.2f} s {args.prompt_len / medians[n]:8.1f} tok/s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps(
        {"prompt_len": args.prompt_len, "model": _name(args.model), "gguf": _name(args.gguf),
         "runs": runs, "median_ttft_s": medians}, indent=1))
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [args.prompt_len / medians[n] for n in names])
    ax.set_ylabel(f"prefill tok/s ({args.prompt_len}-token prompt)")
    ax.tick_params(axis="x", labelrotation=20)
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=120)


def _name(path):
    """A file or folder as the JSON records it: its name, never the machine's own path."""
    return None if path is None else Path(path).name
