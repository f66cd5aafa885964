"""Where a decode step's main-thread CPU goes, part by part, edgemoe beside mlx-lm (#50).

    python scripts/hotpath_parts.py [--model edgemoe/models/fine] [--budgets 50%]
           [--tokens 32] [--rounds 6] [--out DIR]

bench_hotpath measures the whole: main-thread CPU per MoE layer over mlx-lm's. This splits
it. Each part's function is wrapped in a timer (`time.thread_time`, about 1 us a timer) and
summed over greedy decodes of the same prompt, mlx-lm's model and each budget in turn, the
order alternating by round; figures per decoded token and per MoE layer:

- attention, the MoE block, and mlx-lm's expert graph (`SwitchGLU`: its graph, built);
- edgemoe's expert call, and inside it: the routing sync (its evaluation, then the release
  of the slots that earlier layers held), the slots' claim (misses' reads started), the
  wait for the misses (`finish`), the slots' release.

Parts nest (a call holds its sync), so they do not add up to the total. Beside them, each
claim by itself: main-thread CPU of one call's claim (median), for the calls that were all
hits and for those with misses, and how many had misses. Writes DIR/hotpath_parts.json.
"""

import argparse
import collections
import contextlib
import functools
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import switch_layers
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.format.source import BUNDLED_MODEL
from edgemoe.mlx_backend import experts, hostsync
from edgemoe.streaming.slots import LayerSlots

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_hotpath import ROOT, EvalCounter, decode, mlx_lm_folder  # noqa: E402


@contextlib.contextmanager
def timers(parts: dict, spent: collections.Counter):
    """While installed, each `name: (owner, attribute)` of `parts` adds its main-thread CPU
    to `spent[name]`."""
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr in parts.values()]

    def timed(name, function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            start = time.thread_time()
            try:
                return function(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - start
        return wrapper

    for (name, (owner, attr)), (_, _, function) in zip(parts.items(), originals):
        setattr(owner, attr, timed(name, function))
    try:
        yield
    finally:
        for owner, attr, function in originals:
            setattr(owner, attr, function)


@contextlib.contextmanager
def claims_timed(calls: dict):
    """While installed, each claim's main-thread CPU goes to `calls["all hits"]` or
    `calls["with misses"]` (a claim returns the fills of its misses)."""
    claim = LayerSlots.claim

    def timed(self, wanted):
        start = time.thread_time()
        fills = claim(self, wanted)
        if fills is not None:
            calls["with misses" if fills else "all hits"].append(time.thread_time() - start)
        return fills

    LayerSlots.claim = timed
    try:
        yield
    finally:
        LayerSlots.claim = claim


def parts_of(model) -> dict:
    """The parts timed: name -> (owner, attribute). Attention and the MoE block are the
    model's own classes (a MoE block holds `switch_mlp`)."""
    layer = next(x for x in model.layers if hasattr(getattr(x, "mlp", None), "switch_mlp"))
    return {"attention": (type(layer.self_attn), "__call__"),
            "MoE block": (type(layer.mlp), "__call__"),
            "expert graph (SwitchGLU)": (switch_layers.SwitchGLU, "__call__"),
            "edgemoe expert call": (experts.StreamingExperts, "__call__"),
            "  routing sync": (hostsync.QueuedReads, "sync"),
            "    its evaluation": (hostsync, "wait"),
            "  claim": (LayerSlots, "claim"),
            "  wait for misses (finish)": (LayerSlots, "finish"),
            "  release": (LayerSlots, "release")}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=BUNDLED_MODEL)
    p.add_argument("--budgets", default="50%")
    p.add_argument("--prompt", type=int, default=48)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--out", type=Path, default=Path("runs/hotpath_parts"))
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="hotpath_parts-") as scratch:
        reference, tokenizer = mlx_lm_load(str(mlx_lm_folder(args.model, Path(scratch))))
    models = {"mlx-lm": reference}
    for budget in args.budgets.split(","):
        models[budget], _ = edgemoe.load(args.model, expert_budget=budget)
    layers = len(models[budget].expert_store.layer_indices)
    prompt = mx.array(tokenizer.encode((ROOT / "README.md").read_text())[:args.prompt])
    counter, parts = EvalCounter(), parts_of(reference)
    spent = {name: collections.Counter() for name in models}
    claims = {name: {"all hits": [], "with misses": []} for name in models}
    tokens = collections.Counter()
    for model in models.values():  # warm: page cache, slots
        decode(model, prompt, args.tokens, counter)
    for r in range(args.rounds):
        for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
            with timers(parts, spent[name]), claims_timed(claims[name]):
                result = decode(models[name], prompt, args.tokens, counter)
            n = len(result["tokens"]) - 1
            tokens[name] += n
            spent[name]["total (a decode step)"] += result["cpu_us_per_token"] * n / 1e6
        print(f"round {r} done", flush=True)
    table = {name: {part: {"us_per_token": 1e6 * s / tokens[name],
                           "us_per_moe_layer": 1e6 * s / tokens[name] / layers}
                    for part, s in spent[name].items()} for name in models}
    per_claim = {name: {kind: {"us_median": 1e6 * statistics.median(t), "calls": len(t)}
                        for kind, t in claims[name].items() if t} for name in models}
    for name in models:
        store = getattr(models[name], "expert_store", None)
        if store is not None:
            store.close()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "hotpath_parts.json").write_text(json.dumps(
        {"model": str(args.model), "moe_layers": layers, "rounds": args.rounds,
         "tokens": args.tokens, "parts": table, "claim_per_call": per_claim,
         "command": " ".join(sys.argv)}, indent=1))
    print(f"{'part':>28} " + " ".join(f"{n + ' us/layer':>16}" for n in models))
    for part in ["total (a decode step)", *parts]:
        print(f"{part:>28} " + " ".join(
            f"{table[n].get(part, {}).get('us_per_moe_layer', 0.0):16.1f}" for n in models))
    for name, kinds in per_claim.items():
        if kinds:
            print(f"{name}: a claim, median: " + ", ".join(
                f"{kind} {k['us_median']:.1f} us ({k['calls']} calls)"
                for kind, k in kinds.items()))


if __name__ == "__main__":
    main()
