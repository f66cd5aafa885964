"""Routing statistics of a MoE on held-out text, beside the published figures of real models.

Two steps. `record` decodes held-out passages teacher-forced (each passage's prompt is
prefilled, then its own next tokens are fed one at a time, whatever the model would have
sampled: greedy decode of a small model falls into loops and flatters every cache) at a
100% expert budget with native routing, and saves one routing trace per passage
(edgemoe.streaming.trace's format; its decode tokens are the ones cache replays count):

    python scripts/routing_stats.py record --model PACK --out TRACES \\
        --text HELDOUT_stdlib.txt,HELDOUT_docs.txt --passages 4 --prompt 128 --decode 256

`report` reads traces and prints, per MoE layer and over all of them, the statistics that
decide how well a cache and a prefetcher can do (all over the traces' tokens, prompt and
decoded alike: teacher-forced, both are the held-out text):

- busiest: the busiest expert's share of all selections (uniform: 1/E);
- cover90: the share of the experts needed to cover 90% of the selections;
- overlap: the share of a token's k experts the previous token also used;
- reuse@d: the share of a token's experts used by any of the d tokens before it;
- union@w: distinct experts in a window of w tokens over w*k (1: no reuse at all).

    python scripts/routing_stats.py report TRACES/*.npz [--json OUT.json] [--markdown OUT.md]
"""

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List

import numpy as np

REUSE = (1, 4, 16)
WINDOWS = (2, 4, 8)
# Targets for a reference model with realistic routing, and what is published for real ones.
TARGETS = {"busiest": ("<=", 0.10), "cover90": (">=", 0.35), "overlap": ("between", (0.2, 0.5))}
PUBLISHED = [  # (model, statistic, figure)
    ("Qwen3-30B-A3B (128 experts, top-8)", "busiest", "4-6%"),
    ("Qwen3-30B-A3B (128 experts, top-8)", "cover90", "45-51% (58-65 of 128)"),
    ("Qwen3-30B-A3B (128 experts, top-8)", "overlap", "0.45"),
    ("GLM-4.7-Flash", "overlap", "0.26"),
    ("a 256-expert top-8 model", "union@8", "0.62 (38% of a window's experts repeated)"),
]


# ---------------------------------------------------------------- statistics
def layer_stats(sequences: List[np.ndarray], num_experts: int) -> Dict[str, float]:
    """Statistics of one layer's routing: each sequence an int array (tokens, k) of expert ids."""
    k = sequences[0].shape[1]
    counts = np.zeros(num_experts, dtype=np.int64)
    for ids in sequences:
        counts += np.bincount(ids.ravel(), minlength=num_experts)
    ranked = np.sort(counts)[::-1]
    cover = int(np.searchsorted(np.cumsum(ranked), 0.9 * counts.sum()) + 1)
    out = {"busiest": float(ranked[0] / counts.sum()), "cover90": cover / num_experts}
    for d in REUSE:
        out[f"reuse@{d}"] = _mean([_reused(ids, d) for ids in sequences], k)
    out["overlap"] = out["reuse@1"]
    for w in WINDOWS:
        unions = [len(np.unique(ids[s:s + w])) for ids in sequences for s in range(0, len(ids) - w + 1, w)]
        out[f"union@{w}"] = float(np.mean(unions) / (w * k)) if unions else float("nan")
    return out


def _reused(ids: np.ndarray, d: int) -> List[int]:
    """For each token after the first d, how many of its experts the d tokens before it used."""
    return [len(np.intersect1d(ids[t], ids[t - d:t])) for t in range(d, len(ids))]


def _mean(per_sequence: List[List[int]], k: int) -> float:
    hits = [h for seq in per_sequence for h in seq]
    return float(np.mean(hits) / k) if hits else float("nan")


def trace_stats(traces: List[Dict[str, np.ndarray]]) -> Dict[str, object]:
    """Per-layer statistics over several traces (each a sequence), and their mean over layers."""
    layers = traces[0]["layers"].tolist()
    num_experts = traces[0]["num_experts"].tolist()
    for t in traces:
        if t["layers"].tolist() != layers or t["num_experts"].tolist() != num_experts:
            raise ValueError("traces of different models: report them apart")
    per_layer = [layer_stats([t["routed"][:, i, :] for t in traces], num_experts[i])
                 for i in range(len(layers))]
    keys = list(per_layer[0])
    mean = {key: float(np.mean([s[key] for s in per_layer])) for key in keys}
    worst = {"busiest": max(s["busiest"] for s in per_layer),
             "cover90": min(s["cover90"] for s in per_layer)}
    k = int(traces[0]["routed"].shape[2])
    return {"layers": layers, "num_experts": num_experts, "top_k": k,
            "tokens": int(sum(len(t["routed"]) for t in traces)), "per_layer": per_layer,
            "mean": mean, "worst": worst, "within_targets": within_targets(mean, worst)}


def within_targets(mean: Dict[str, float], worst: Dict[str, float]) -> Dict[str, bool]:
    """Each target checked where it binds: the busiest and the least covered layer, the mean overlap."""
    lo, hi = TARGETS["overlap"][1]
    return {"busiest": worst["busiest"] <= TARGETS["busiest"][1],
            "cover90": worst["cover90"] >= TARGETS["cover90"][1],
            "overlap": lo <= mean["overlap"] <= hi}


def markdown(report: Dict[str, object], title: str = "") -> str:
    keys = ["busiest", "cover90", "overlap"] + [f"reuse@{d}" for d in REUSE[1:]] + [f"union@{w}" for w in WINDOWS]
    lines = [f"{title}{report['tokens']:,} tokens, {report['num_experts'][0]} experts, top-{report['top_k']}",
             "", "| layer | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    for layer, s in zip(report["layers"], report["per_layer"]):
        lines.append(f"| {layer} | " + " | ".join(_fmt(key, s[key]) for key in keys) + " |")
    lines.append("| mean | " + " | ".join(_fmt(key, report["mean"][key]) for key in keys) + " |")
    ok = report["within_targets"]
    lines += ["", "Targets: busiest expert <= 10% in every layer ({}), 90% coverage needing >= 35% of "
              "the experts in every layer ({}), next-token overlap 0.2-0.5 ({}).".format(
                  *("met" if ok[key] else "MISSED" for key in ("busiest", "cover90", "overlap")))]
    return "\n".join(lines)


def _fmt(key: str, value: float) -> str:
    return f"{100 * value:.1f}%" if key in ("busiest", "cover90") else f"{value:.2f}"


# ---------------------------------------------------------------- recording
def record(model_path: str, texts: List[Path], out: Path, passages: int, prompt: int, decode: int):
    """One teacher-forced trace per passage: evenly spaced passages of each text."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from tqdm import tqdm

    import edgemoe

    model, tokenizer = edgemoe.load(model_path, expert_budget=1.0)
    store = model.expert_store
    out.mkdir(parents=True, exist_ok=True)
    jobs = []
    for text in texts:
        ids = tokenizer.encode(text.read_text(encoding="utf-8"))
        span = prompt + decode + 1
        if len(ids) < passages * span:
            raise SystemExit(f"{text}: expected at least {passages * span} tokens for {passages} "
                             f"passages of {span}, found {len(ids)}")
        starts = np.linspace(0, len(ids) - span, passages).astype(int)
        jobs += [(out / f"{text.stem}_{i}.npz", ids[s:s + span]) for i, s in enumerate(starts)]
    for path, ids in tqdm(jobs, desc="record", unit="passage"):
        following = iter(ids[prompt:])
        forced = lambda logprobs: mx.array([next(following)] * logprobs.shape[0])  # noqa: E731
        trace = store.start_trace()
        for _ in generate_step(mx.array(ids[:prompt]), model, max_tokens=decode, sampler=forced):
            pass
        trace.save(path)
    print(f"wrote {len(jobs)} traces to {out}")


# ---------------------------------------------------------------- CLI
def main(argv=None):
    from edgemoe.streaming.trace import load_trace

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="teacher-forced routing traces of held-out passages")
    r.add_argument("--model", required=True)
    r.add_argument("--text", required=True, help="comma-separated held-out text files")
    r.add_argument("--out", required=True, type=Path)
    r.add_argument("--passages", type=int, default=4, help="passages per text")
    r.add_argument("--prompt", type=int, default=128, help="tokens prefilled per passage")
    r.add_argument("--decode", type=int, default=256, help="tokens decoded per passage, teacher-forced")
    s = sub.add_parser("report", help="statistics of traces, per layer")
    s.add_argument("traces", nargs="+", type=Path)
    s.add_argument("--json", type=Path)
    s.add_argument("--markdown", type=Path)
    args = p.parse_args(argv)
    if args.command == "record":
        return record(args.model, [Path(t) for t in args.text.split(",")], args.out,
                      args.passages, args.prompt, args.decode)
    try:
        traces = [load_trace(t) for t in args.traces]
        report = trace_stats(traces)
    except (FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    text = markdown(report)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(text + "\n")


if __name__ == "__main__":
    main()
