"""The quality-speed frontier of the routing modes (issue #52): one command, a JSON and a
picture.

    python scripts/frontier.py --text unseen=U.txt --text stdlib=S.txt ... --out DIR
        [--heads edgemoe/models/fine/prerouter] [--configs NAME,...] [--max-tokens N]

For native and each mode (`CONFIGS`), on each text (held-out text only): perplexity, KL
to native and top-1 agreement with native (teacher-forced windows of --context tokens,
one forward call each, with every expert resident: the routing, not the cache, decides
the quality; the prerouted modes carry predictions from position to position as decode
does). Bytes read per token at 10% and 25%: the routing the mode used, replayed through
the store's own slots (edgemoe.whatif.replay, LFU) as one teacher-forced decode per
text; cache-conditional routing reads its prediction and routes by the slots it
simulates, so it is measured at each budget on its own. And a FORECAST of decode tok/s
of qwen3-30b-a3b on m4-pro-24gb (edgemoe.whatif.twin.forecast's analytic model, the mode's
routing trace mapped onto the shape): exact modes wait for their reads; modes whose
routing is the heads' read a token ahead; cache-conditional routing reads a token ahead
but keeps native's routing syncs, its bytes scaled from native's by its replayed ratio;
per-layer fallback's native layers wait for their reads.

DIR/frontier.json, DIR/frontier.png (KL to native on the unseen text against the forecast
tok/s at 25%), and a Markdown table on stdout (docs/routing.md's).
"""

import argparse
import json
import math
import pickle
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgemoe.mlx_backend.experts import streaming_of  # noqa: E402
from edgemoe.mlx_backend.loader import load  # noqa: E402
from edgemoe.options import StreamOptions  # noqa: E402
from edgemoe.mlx_backend.conditional import SlotSim, install_conditional  # noqa: E402
from edgemoe.routing.between import plain_heads, with_native_layers  # noqa: E402
from edgemoe.format.adapters import adapter_subset, expert_key  # noqa: E402
from edgemoe.format.deltas import MANIFEST as DELTAS_MANIFEST, expert_deltas  # noqa: E402
from edgemoe.format.pack import Pack  # noqa: E402
from edgemoe.format.resident import read_safetensors_header  # noqa: E402
from edgemoe.mlx_backend.gates import moe_blocks  # noqa: E402
from edgemoe.streaming.budget import SlotPlan  # noqa: E402
from edgemoe.streaming.cache import make_policy  # noqa: E402
from edgemoe.whatif.replay import simulate  # noqa: E402
from plotting import pyplot  # noqa: E402

PACK = ROOT / "edgemoe" / "models" / "fine"
BUDGETS = ("10%", "25%")
SHAPE, MACHINE = "qwen3-30b-a3b", "m4-pro-24gb"
FORECAST_TOKENS = 1024  # of native's trace, replayed on the shape (48 layers: slow)

# name -> how it routes: routing, adapter, native layers (fallback-0-j: MoE layers 0..j keep
# their router), top-k, conditional (the router among the slots and the heads' m most likely)
CONFIGS = {
    "native": dict(routing="native"),
    "native-top4": dict(routing="native", top_k=4),
    "shipped": None,  # the --heads folder's own configuration (shipped_spec)
    "shipped-top4": None,  # it, each token routed to 4 experts (--experts-per-token 4)
    "prerouted": dict(routing="prerouted"),
    "prerouted+adapter": dict(routing="prerouted", adapter=True),
    "fallback-0-1": dict(routing="prerouted", native_layers=[1]),
    "fallback-0-2": dict(routing="prerouted", native_layers=[1, 2]),
    "fallback-0-3": dict(routing="prerouted", native_layers=[1, 2, 3]),
    "fallback-0-4": dict(routing="prerouted", native_layers=[1, 2, 3, 4]),
    "fallback-0-5": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5]),
    "fallback-0-2+adapter": dict(routing="prerouted", native_layers=[1, 2], adapter=True),
    "fallback-0-3+adapter": dict(routing="prerouted", native_layers=[1, 2, 3], adapter=True),
    "fallback-0-4+adapter": dict(routing="prerouted", native_layers=[1, 2, 3, 4], adapter=True),
    "fallback-0-5+adapter": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5],
                                 adapter=True),
    "prerouted-top4": dict(routing="prerouted", top_k=4),
    "fallback-0-3-top4": dict(routing="prerouted", native_layers=[1, 2, 3], top_k=4),
    "fallback-0-5-top4": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5], top_k=4),
    "conditional-8": dict(routing="prerouted", conditional=8),
    "conditional-16": dict(routing="prerouted", conditional=16),
    "conditional-8-top4": dict(routing="prerouted", conditional=8, top_k=4),
    "conditional-16-top4": dict(routing="prerouted", conditional=16, top_k=4),
    "conditional-4-top4": dict(routing="prerouted", conditional=4, top_k=4),
    "conditional-8-top4+adapter": dict(routing="prerouted", conditional=8, top_k=4,
                                       adapter=True),
    "fallback-0-3-conditional-8": dict(routing="prerouted", native_layers=[1, 2, 3],
                                       conditional=8),
    "fallback-0-4-conditional-8": dict(routing="prerouted", native_layers=[1, 2, 3, 4],
                                       conditional=8),
    "fallback-0-5-conditional-8": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5],
                                       conditional=8),
    "fallback-0-3-conditional-8-top4": dict(routing="prerouted", native_layers=[1, 2, 3],
                                            conditional=8, top_k=4),
    "fallback-0-5+adapter-6-7": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5],
                                     adapter=[6, 7]),
    "fallback-0-6": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5, 6]),
    "fallback-0-6+adapter-7": dict(routing="prerouted", native_layers=[1, 2, 3, 4, 5, 6],
                                   adapter=[7]),
    "fallback-0-3+adapter-4-7": dict(routing="prerouted", native_layers=[1, 2, 3],
                                     adapter=[4, 5, 6, 7]),
    "fallback-0-4+adapter-5-7": dict(routing="prerouted", native_layers=[1, 2, 3, 4],
                                     adapter=[5, 6, 7]),
    "conditional-8+adapter": dict(routing="prerouted", conditional=8,
                                               adapter=True),
    # the shipped configuration with the pack's adapter: on all layers or on the predicted
    # ones (5-7); "-attn": its attention LoRA only (no expert deltas, no extra bytes)
    "fallback-0-4-conditional-8+adapter": dict(routing="prerouted", native_layers=[1, 2, 3, 4],
                                               conditional=8, adapter=True),
    "fallback-0-4-conditional-8+adapter-5-7": dict(routing="prerouted",
                                                   native_layers=[1, 2, 3, 4], conditional=8,
                                                   adapter=[5, 6, 7]),
    "fallback-0-4-conditional-8+adapter-attn": dict(routing="prerouted",
                                                    native_layers=[1, 2, 3, 4], conditional=8,
                                                    adapter=True, attention_only=True),
    "fallback-0-4-conditional-8+adapter-attn-5-7": dict(routing="prerouted",
                                                        native_layers=[1, 2, 3, 4],
                                                        conditional=8, adapter=[5, 6, 7],
                                                        attention_only=True),
}


def shipped_spec(heads: Path) -> dict:
    """The spec of the heads folder's own configuration (the pack's: the default of
    --routing prerouted)."""
    config = json.loads((heads / "prerouter_config.json").read_text())
    spec = dict(routing="prerouted")
    if set(config.get("native_layers", [0])) - {0}:
        spec["native_layers"] = sorted(set(config["native_layers"]) - {0})
    if config.get("conditional"):
        spec["conditional"] = config["conditional"]
    if config.get("route_top_k"):
        spec["top_k"] = config["route_top_k"]
    if config.get("adapter"):  # the heads' own adapter: its layers, and whether it adapts
        folder = heads / config["adapter"]  # the experts (their deltas' bytes count)
        names = read_safetensors_header(folder / "adapters.safetensors")[0]
        spec.update(adapter_path=str(folder),
                    adapter=sorted({int(n.split(".")[2]) for n in names}),
                    attention_only=not any(expert_key(n) for n in names))
    return spec


def load_config(spec: dict, heads: Path, work: Path, slots: int = 0):
    """The model routed as `spec` says (every expert resident)."""
    if spec.get("native_layers"):
        heads = with_native_layers(heads, spec["native_layers"],
                                   work / ("heads_native_" + "_".join(map(str, spec["native_layers"]))))
    adapter = spec.get("adapter") and str(PACK / "adapter")
    if spec.get("adapter_path"):  # the heads' own
        adapter = spec["adapter_path"]
    elif isinstance(spec.get("adapter"), list) or spec.get("attention_only"):
        layers = spec["adapter"] if isinstance(spec["adapter"], list) else range(8)
        adapter = str(adapter_subset(  # only these layers adapted (or their attention)
            PACK / "adapter",
            work / ("adapter_" + "_".join(map(str, layers))
                    + ("_attn" if spec.get("attention_only") else "")),
            layers, attention_only=bool(spec.get("attention_only"))))
    options = StreamOptions.of(None, expert_budget="1.0", routing=spec["routing"],
                               prerouter_path=str(heads) if spec["routing"] == "prerouted" else None,
                               adapter_path=adapter or None,
                               experts_per_token=spec.get("top_k"))  # reduced top-k
    model, tokenizer = load(str(PACK), options)
    blocks = moe_blocks(model)
    taps = None
    if spec.get("conditional"):
        predictor = streaming_of(model).routing.predictor
        taps = install_conditional(predictor, blocks, slots, spec["conditional"],
                                   lambda: make_policy("lfu"))
    return model, tokenizer, taps


def package_text(name: str) -> str:
    """The unseen text of an installed package: every 4th of its `.py` files, sorted by
    path, joined by a blank line."""
    import importlib.util
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--text ...=pkg:{name}: expected an installed package, found none")
    root = Path(list(spec.submodule_search_locations)[0])
    files = sorted(root.rglob("*.py"))[::4]
    return "\n\n".join(f.read_text(encoding="utf-8", errors="replace") for f in files)


def read_text(source: str) -> str:
    """A --text's FILE: a path, or pkg:NAME (package_text)."""
    if source.startswith("pkg:"):
        return package_text(source[4:])
    return Path(source).read_text()


def windows(tokens, context):
    return [np.array(tokens[i:i + context + 1]) for i in range(0, len(tokens) - 1, context)
            if len(tokens[i:i + context + 1]) > 1]


def run_text(model, tokens, context, native_lps=None):
    """Log-probs of every window, and the routing trace of the whole text as decode."""
    store = streaming_of(model).store
    recorder = store.start_trace()
    lps = []
    for w in windows(tokens, context):
        logits = model(mx.array(w[None, :-1]))[0].astype(mx.float32)
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        mx.eval(lp)
        lps.append(np.array(lp))
    trace = recorder.as_trace()
    store.trace = None
    for slots in store.layers.values():
        slots.trace = None
    n = len(trace["decode"])
    trace.update(decode=np.ones(n, dtype=bool), calls=np.ones(n, dtype=np.int32))
    return lps, trace


def line_spans(tokens, tokenizer):
    """The text's lines as spans [a, b] of token positions: a follows a token holding a
    newline, b is the next token holding one (the line's own newline); lines of
    whitespace only are left out."""
    pieces = [tokenizer.decode([t]) for t in tokens]
    breaks = [j for j, piece in enumerate(pieces) if "\n" in piece]
    return [(a + 1, b) for a, b in zip(breaks, breaks[1:])
            if ("".join(pieces[a + 1:b]) + pieces[b].split("\n")[0]).strip()]


def next_line_match(greedy: np.ndarray, tokens, spans) -> float:
    """Exact match of the next line: the share of lines whose every token is the greedy
    choice given the text before it. Greedy decoding from a line's start writes exactly
    that line (its newline included) iff it does (each step sees the true prefix)."""
    tokens = np.asarray(tokens)
    return float(np.mean([(greedy[a:b + 1] == tokens[a:b + 1]).all() for a, b in spans]))


def choice_questions(tokens, spans, count: int, context: int = 64, seed: int = 0):
    """A multiple-choice set built from held-out text: "which line comes next?" after the
    `context` tokens before a line, the line itself against 3 other lines of the text (of
    1 to 24 tokens), drawn by a seeded generator. [(context tokens, [right, wrong...])]."""
    tokens = list(tokens)
    lines = [tokens[a:b + 1] for a, b in spans if 1 <= b + 1 - a <= 24]
    starts = [a for a, b in spans if 1 <= b + 1 - a <= 24]
    rng = np.random.default_rng(seed)
    asked = [i for i in range(len(lines)) if starts[i] >= context]
    questions = []
    for i in rng.permutation(asked)[:count]:
        others = [j for j in range(len(lines)) if lines[j] != lines[i]]
        wrong = [lines[j] for j in rng.choice(others, 3, replace=False)]
        questions.append((tokens[starts[i] - context:starts[i]], [lines[i]] + wrong))
    return questions


def choice_accuracy(model, questions) -> float:
    """The share of questions whose right line the model ranks first, by the mean
    log-prob of each line's tokens after the context (the four in one batch, padded)."""
    right = 0
    for context, choices in questions:
        width = len(context) + max(map(len, choices))
        rows = np.zeros((len(choices), width), dtype=np.int64)
        for r, choice in enumerate(choices):
            rows[r, :len(context) + len(choice)] = context + choice
        logits = model(mx.array(rows[:, :-1])).astype(mx.float32)
        lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
        means = [np.mean([lp[r, len(context) - 1 + t, tok] for t, tok in enumerate(choice)])
                 for r, choice in enumerate(choices)]
        right += int(np.argmax(means) == 0)
    return right / len(questions)


def scores(lps, native_lps, tokens, context, spans=None):
    nll = agree = kl = count = 0.0
    greedy = np.full(len(tokens), -1)  # greedy[j]: the choice for token j given those before
    start = 0
    for w, lp, nlp in zip(windows(tokens, context), lps, native_lps):
        targets = w[1:]
        nll -= lp[np.arange(len(targets)), targets].sum()
        agree += (lp.argmax(-1) == nlp.argmax(-1)).sum()
        kl += (np.exp(nlp) * (nlp - lp)).sum()
        greedy[start + 1:start + 1 + len(targets)] = lp.argmax(-1)
        start += len(targets)
        count += len(targets)
    out = {"tokens": int(count), "perplexity": math.exp(float(nll) / count),
           "kl": float(kl) / count, "top1": float(agree) / count}
    if spans:
        out["next_line"] = next_line_match(greedy, tokens, spans)
    return out


def bytes_per_token(trace, budget) -> float:
    r = simulate(trace, budget, "lfu")
    return r.decode_bytes_read / int(trace["decode"].sum())


class Forecast:
    """Decode tok/s on SHAPE at MACHINE (analytic FORECAST, edgemoe.whatif.twin.forecast's model).
    Native's bytes per token on the shape come from its trace mapped onto the shape and
    replayed (LFU); a mode's are native's scaled by the ratio of the two on the bundled
    model (the map keeps each token's routing, so hit rates carry over)."""

    def __init__(self, native_trace: dict):
        from edgemoe.whatif.twin.profiles import load_profile
        from edgemoe.whatif.twin.shapes import SHAPES, map_trace

        self.shape, self.profile = SHAPES[SHAPE], load_profile(MACHINE)
        first = {k: v[:FORECAST_TOKENS] if k in ("routed", "decode", "calls") else v
                 for k, v in native_trace.items()}
        mapped = map_trace(first, self.shape)
        tokens = int(mapped["decode"].sum())
        self.native_bytes = {b: simulate(mapped, b, "lfu").decode_bytes_read / tokens
                             for b in BUDGETS}
        record = self.shape.record_bytes
        self.rate = record / self.profile.read_s(record, 2)

    def tok_s(self, budget, kind: str, top_k: int, bytes_ratio: float,
              native_share: float = 0.0) -> float:
        from edgemoe.whatif.twin.compute import Compute

        shape = replace(self.shape, top_k=top_k)
        c = Compute.from_profile(self.profile, shape)
        compute = shape.layers * (c.resident_layer_s(1) + c.experts_s(top_k, top_k)) + c.head_s
        sync = c.host_sync_s
        read = self.native_bytes[budget] * bytes_ratio / self.rate
        if kind == "exact":  # reads wait
            return 1 / (compute + (2 * shape.layers + 1) * sync + read)
        # the layers that keep their router (`native_share` of them, the first included)
        # wait for their reads; the others' are read a token ahead
        ahead, waits = read * (1 - native_share), read * native_share
        if kind == "conditional":  # routing syncs as native's
            syncs = 2 * shape.layers + 1
        else:  # a predicted layer skips its routing sync, a native one keeps it
            syncs = shape.layers * (1 + native_share) + 1
        return 1 / (max(compute + syncs * sync, ahead) + waits)


def measure(name, spec, texts, heads, work, context, native, spans, questions=()):
    """Quality per text (and the multiple-choice set's accuracy) and bytes/forecasts at
    each budget for one configuration."""
    out = {"name": name, "spec": spec, "texts": {}, "budgets": {}}
    top_k = spec.get("top_k") or 8
    budgets = BUDGETS if spec.get("conditional") else (None,)
    for budget in budgets:
        slots = 0
        if budget:
            plan = SlotPlan((1,) * 8, (128,) * 8, 8)
            slots = plan.slots(budget)
        model, tok, taps = load_config(spec, heads, work, slots)
        traces = {}
        for tname, tokens in texts.items():
            t0 = time.time()
            if taps:  # the slots of each text start empty, as its own decode
                for tap in taps.values():
                    tap.sim.__init__(slots, make_policy("lfu"))
                    tap.exact = tap.tokens = 0
            lps, trace = run_text(model, tokens, context)
            traces[tname] = trace
            if native is None:  # this is native: keep its log-probs
                out["texts"][tname] = {"perplexity": None, "_lps": lps}
                entry = scores(lps, lps, tokens, context, spans[tname])
            else:
                entry = scores(lps, native["texts"][tname]["_lps"], tokens, context,
                               spans[tname])
            if taps:
                entry["exact_share"] = float(sum(t.exact for t in taps.values()) / max(
                    1, sum(t.tokens for t in taps.values())))
                # every layer's loads: the predicted layers' simulated slots, the first
                # layer's (native) replayed as the store would
                entry["loads"] = sum(t.sim.loads for t in taps.values()) + native_loads(
                    trace, slots, native_layers_of(spec, heads))
            key = tname if budget is None else f"{tname}@{budget}"
            out["texts"].setdefault(key, {}).update(entry)
            print(f"  {name} {key}: ppl {entry['perplexity']:.2f} kl {entry['kl']:.4f} "
                  f"top1 {entry['top1']:.3f} ({time.time() - t0:.0f} s)", flush=True)
        if questions:  # (cache-conditional slots carry on from the last text)
            t0, key = time.time(), "choices" if budget is None else f"choices@{budget}"
            out["choices"] = out.get("choices", {})
            out["choices"][key] = choice_accuracy(model, questions)
            print(f"  {name} {key}: {out['choices'][key]:.1%} of {len(questions)} "
                  f"({time.time() - t0:.0f} s)", flush=True)
        out["traces"] = out.get("traces", {})
        out["traces"][budget] = traces
    return out


def speed(result, native, heads_native_layers, forecast: "Forecast"):
    """Experts read per token (bundled model, all layers) and forecast tok/s (SHAPE) per
    budget: each text's trace replayed from empty slots, the texts' tokens together."""
    spec = result["spec"]
    top_k = spec.get("top_k") or 8
    for budget in BUDGETS:
        if spec.get("conditional"):
            texts = [k for k in result["texts"] if k.endswith("@" + budget)]
            loads = sum(result["texts"][k]["loads"] for k in texts)
            experts = loads / sum(result["texts"][k]["tokens"] for k in texts)
            kind = "conditional"
        else:
            experts = replayed_experts(result["traces"][None], budget)
            kind = "exact" if spec["routing"] == "native" else "prerouted"
        native_layers = set(heads_native_layers) | set(spec.get("native_layers", []))
        share = len(native_layers) / 8 if kind != "exact" else 1.0  # waiting for reads
        ratio = 1.0 if result is native else \
            experts / native["budgets"][budget]["experts_per_token"]
        record = int(next(iter(native["traces"][None].values()))["expert_bytes"][0])
        if spec.get("adapter") and not spec.get("attention_only"):  # each expert's delta
            # rides with it: more bytes a read
            adapted = len(spec["adapter"]) / 8 if isinstance(spec["adapter"], list) else 1
            more = 1 + adapted * (delta_share(adapter_of(spec)) - 1)  # (layers' reads equal)
            ratio *= more
            experts *= more  # (in experts' worth of bytes)
            result["deltas_counted"] = True
        result["budgets"][budget] = {
            "experts_per_token": float(experts), "kb_per_token": float(experts) * record / 1024,
            "forecast_tok_s": float(forecast.tok_s(budget, kind, top_k, ratio, share))}


def native_layers_of(spec, heads) -> set:
    """The MoE layers that keep their router: the heads' config's and the spec's."""
    config = json.loads((Path(heads) / "prerouter_config.json").read_text())
    return set(config.get("native_layers", [0])) | set(spec.get("native_layers", []))


def native_loads(trace, slots, layers) -> int:
    """What the layers that keep their router load, their routing replayed through slots
    as the store would."""
    loads = 0
    for layer in sorted(layers):
        sim = SlotSim(slots, make_policy("lfu"))
        for ids in trace["routed"][:, layer]:
            sim.step(ids.tolist())
        loads += sim.loads
    return loads


def adapter_of(spec: dict) -> Path:
    """The adapter a row loads: the heads' own (`shipped`: whatever adapter those heads
    carry, another rank's too), else the pack's or a subset of it (same record sizes)."""
    return ROOT / (spec.get("adapter_path") or PACK / "adapter")  # (a JSON's: repo-relative)


def delta_share(adapter: Path) -> float:
    """(expert record + its delta) / expert record, of `adapter` (the one the row loads:
    a delta's size follows its rank), its first adapted layer."""
    expert = json.loads((PACK / "manifest.json").read_text())["layers"][0]["records"][0][1]
    records = expert_deltas(adapter, Pack.open(PACK))  # written first if missing, as loading
    if records is None:  # an attention-only adapter
        return 1.0
    delta = json.loads((records.path.parent / DELTAS_MANIFEST).read_text())
    return 1 + delta["layers"][0]["records"][0][1] / expert


def replayed_experts(traces: dict, budget) -> float:
    """Experts loaded per token, each text's trace replayed through the store's slots."""
    loads = tokens = 0
    for trace in traces.values():
        loads += simulate(trace, budget, "lfu").decode_bytes_read / int(trace["expert_bytes"][0])
        tokens += int(trace["decode"].sum())
    return loads / tokens


def _joined(traces: dict) -> dict:
    """One trace of every text's, one after another (each token a decode step)."""
    parts = list(traces.values())
    joined = dict(parts[0])
    for key in ("routed", "decode", "calls"):
        joined[key] = np.concatenate([p[key] for p in parts])
    return joined


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="only merge frontier.json files of earlier runs (the same texts) "
                        "into --out's, with its table and picture")
    p.add_argument("--text", action="append", metavar="NAME=FILE",
                   help="held-out text (FILE: a path, or pkg:NAME for every 4th .py file of "
                        "an installed package); the first is the headline (the unseen corpus)")
    p.add_argument("--heads", default=str(PACK / "prerouter"))
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--max-tokens", type=int, default=2048, help="per text")
    p.add_argument("--choices", metavar="NAME",
                   help="build the multiple-choice set (which line comes next) from this "
                        "--text")
    p.add_argument("--questions", type=int, default=24)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        return merge([json.loads(Path(f).read_text()) for f in args.merge], out)
    if not args.text:
        p.error("--text NAME=FILE: give the held-out texts")
    names = [n.strip() for n in args.configs.split(",")]
    for n in names:
        if n not in CONFIGS:
            p.error(f"--configs: {n!r}: expected one of {', '.join(CONFIGS)}")
    _, tok = load(str(PACK), StreamOptions.of(None, expert_budget="1.0"))
    texts = {}
    for spec in args.text:
        tname, _, path = spec.partition("=")
        texts[tname] = tok.encode(read_text(path))[:args.max_tokens + 1]
    spans = {tname: line_spans(tokens, tok) for tname, tokens in texts.items()}
    questions = choice_questions(texts[args.choices], spans[args.choices],
                                 args.questions) if args.choices else ()
    CONFIGS["shipped"] = shipped_spec(Path(args.heads))
    CONFIGS["shipped-top4"] = dict(CONFIGS["shipped"], top_k=4)
    heads = plain_heads(Path(args.heads), out / "heads_plain")  # each spec routes from them
    shipped_native = [0]
    cached = out / "native.pkl"  # native's log-probs and traces, for a rerun with other modes
    key = {k: len(v) for k, v in texts.items()}, args.context, args.choices, len(questions)
    native = pickle.loads(cached.read_bytes()) if cached.exists() else None
    if native is None or native.get("key") != key:
        native = measure("native", CONFIGS["native"], texts, heads, out, args.context, None,
                         spans, questions)
        native["key"] = key
        cached.write_bytes(pickle.dumps(native))
    forecast = Forecast(_joined(native["traces"][None]))
    speed(native, native, [], forecast)
    for tname in texts:
        native["texts"][tname].update(scores(native["texts"][tname]["_lps"],
                                             native["texts"][tname]["_lps"], texts[tname],
                                             args.context, spans[tname]))
    results = [native]
    for name in names:
        if name == "native":
            continue
        r = measure(name, CONFIGS[name], texts, heads, out, args.context, native, spans,
                    questions)
        speed(r, native, shipped_native, forecast)
        results.append(r)
        write(results, texts, out, args)
    write(results, texts, out, args)


def shown(path) -> str:
    """A path as frontier.json records it: relative to the repository when inside it (the
    JSON is committed under docs/; no one else has this checkout's absolute path)."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def write(results, texts, out, args):
    rows = []
    for r in results:
        spec = {k: shown(v) if k == "adapter_path" else v for k, v in r["spec"].items()}
        row = {"name": r["name"], "spec": spec, "budgets": r["budgets"],
               "choices": r.get("choices", {}),
               "deltas_counted": r.get("deltas_counted", False),
               "texts": {k: {m: v for m, v in e.items() if not m.startswith("_")}
                         for k, e in r["texts"].items()}}
        rows.append(row)
    result = {"heads": shown(args.heads), "context": args.context,
              "tokens": {k: len(v) - 1 for k, v in texts.items()},
              "forecast": f"{SHAPE} on {MACHINE}: analytic FORECAST (edgemoe.whatif.twin.forecast)",
              "configs": rows}
    (out / "frontier.json").write_text(json.dumps(result, indent=1))
    print_table(result)
    plot(result, out / "frontier.png")


def merge(results, out: Path):
    """One frontier of several runs' (their native rows must agree)."""
    first = dict(results[0])
    natives = {json.dumps(r["configs"][0]["texts"], sort_keys=True) for r in results}
    if len(natives) != 1:
        raise SystemExit("--merge: the runs' native rows differ: other texts or tokens")
    seen = {c["name"] for c in first["configs"]}
    for r in results[1:]:
        first["configs"] += [c for c in r["configs"] if c["name"] not in seen]
        seen |= {c["name"] for c in r["configs"]}
    native = first["configs"][0]
    for row in first["configs"]:  # runs before the deltas' bytes were counted
        if row["spec"].get("adapter") and not row["spec"].get("attention_only") \
                and not row.get("deltas_counted"):
            count_deltas(row, native, out)
    (out / "frontier.json").write_text(json.dumps(first, indent=1))
    print_table(first)
    plot(first, out / "frontier.png")


def count_deltas(row, native, out: Path):
    """An adapter row's bytes and forecast with its experts' deltas (native's traces from
    the cache of a run in `out`)."""
    cached = pickle.loads((out / "native.pkl").read_bytes())
    forecast = Forecast(_joined(cached["traces"][None]))
    spec = row["spec"]
    share = delta_share(adapter_of(spec))
    for budget, b in row["budgets"].items():
        ratio = share * b["experts_per_token"] / native["budgets"][budget]["experts_per_token"]
        kind = "conditional" if spec.get("conditional") else "prerouted"
        b.update(experts_per_token=b["experts_per_token"] * share,
                 kb_per_token=b["kb_per_token"] * share,
                 forecast_tok_s=forecast.tok_s(budget, kind, spec.get("top_k") or 8, ratio,
                                               len({0, *spec.get("native_layers", [])}) / 8))
    row["deltas_counted"] = True


def _choices(row, budget) -> str:
    found = row.get("choices", {})
    accuracy = found.get("choices", found.get(f"choices@{budget}"))
    return "-" if accuracy is None else f"{accuracy:.0%}"


def _line(entry) -> str:
    return f"{entry['next_line']:.1%}" if "next_line" in entry else "-"


def _quality(row, text, budget):
    e = row["texts"].get(text) or row["texts"].get(f"{text}@{budget}")
    return e


def print_table(result):
    texts = list(result["tokens"])
    head = texts[0]
    native_ppl = result["configs"][0]["texts"][head]["perplexity"]
    natives = {t: result["configs"][0]["texts"][t]["perplexity"] for t in texts}
    print(f"| routing | {head}: perplexity (vs native) | KL | top-1 | next line | "
          + "".join(f"{t}: ppl (vs native), next line | " for t in texts[1:])
          + "which line next | experts/token 10% / 25% | forecast tok/s 10% / 25% |")
    print("|---" * (7 + len(texts)) + "|")
    for row in result["configs"]:
        for budget in (BUDGETS if row["spec"].get("conditional") else (BUDGETS[1],)):
            e = _quality(row, head, budget)
            name = row["name"] + (f" @{budget}" if row["spec"].get("conditional") else "")
            others = "".join(
                f"{q['perplexity']:.2f} ({q['perplexity'] / natives[t] - 1:+.1%}), "
                f"{_line(q)} | " for t in texts[1:] for q in [_quality(row, t, budget)])
            b = row["budgets"]
            print(f"| {name} | {e['perplexity']:.2f} ({e['perplexity'] / native_ppl - 1:+.1%}) | "
                  f"{e['kl']:.3f} | {e['top1']:.1%} | {_line(e)} | {others}"
                  f"{_choices(row, budget)} | "
                  f"{b['10%']['experts_per_token']:.1f} / {b['25%']['experts_per_token']:.1f} | "
                  f"{b['10%']['forecast_tok_s']:.1f} / {b['25%']['forecast_tok_s']:.1f} |")


def plot(result, path):
    plt = pyplot()

    head = list(result["tokens"])[0]
    native = result["configs"][0]
    fig, ax = plt.subplots(figsize=(8, 5))
    for row in result["configs"]:
        for budget, marker in (("25%", "o"),):
            e = _quality(row, head, budget)
            x = row["budgets"][budget]["forecast_tok_s"] / native["budgets"][budget]["forecast_tok_s"]
            y = 100 * (e["perplexity"] / native["texts"][head]["perplexity"] - 1)
            ax.scatter(x, y, marker=marker)
            ax.annotate(row["name"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.axhline(5, ls="--", c="gray", lw=0.8)
    ax.axhline(3, ls=":", c="gray", lw=0.8)
    ax.axvline(1.3, ls="--", c="gray", lw=0.8)
    ax.set_xlabel(f"FORECAST decode speed, x native ({SHAPE} on {MACHINE}, 25% budget)")
    ax.set_ylabel(f"perplexity over native on {head}, %")
    ax.set_title("routing modes: quality against speed")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
