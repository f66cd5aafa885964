"""Routing for shapes the shipped traces cannot relabel: fitted per layer, generated per layer.

The bundled model's traces have 128 experts, top-8, 8 layers. Relabelled onto a 256-expert,
40-layer shape (edgemoe.whatif.twin.shapes.map_trace) they use only 128 of the 256 experts and
repeat every 8 layers, which flatters every cache. This module fits, per trace layer, the
two statistics that decide what a cache keeps, and generates routing of any width and depth
from them:

    popularity   the layer's selection shares, sorted (the skew of usage); on a wider
                 layer the sorted curve is stretched over its ranks, so every expert has
                 a share and the skew's shape carries over
    stickiness   the share of a token's experts that the previous token also chose
                 (next-token overlap), as a probability that each previous expert stays

A token keeps each of the previous token's experts with the fitted probability and draws
the rest from the popularity, without replacement. Shape layer l takes the statistics of
trace layer l x L_trace // L_shape (its depth), with its own random permutation of experts
and its own draws: distinct layers. `check` compares the LFU and Belady hit rates of
routing generated from some traces with the hit rates of a held-out one (docs/mac.md,
"Shapes").
"""

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

STICK_STEPS = 7


@dataclass
class LayerStats:
    shares: np.ndarray  # sorted selection shares, descending, sum 1
    overlap: float  # mean share of a token's experts chosen by the previous token too
    stick: float = 0.0  # per-expert probability of staying, fitted to give `overlap`


def _overlap(routed: np.ndarray) -> float:
    """routed (tokens, k): mean |set_t & set_{t-1}| / k."""
    k = routed.shape[1]
    same = [len(np.intersect1d(a, b)) for a, b in zip(routed[1:], routed[:-1])]
    return float(np.mean(same)) / k if same else 0.0


def _sorted_shares(routed: np.ndarray, experts: int) -> np.ndarray:
    counts = np.bincount(routed.reshape(-1), minlength=experts)
    return np.sort(counts / counts.sum())[::-1]


def fit(traces: Sequence[Dict[str, np.ndarray]]) -> List[LayerStats]:
    """Per trace layer: the sorted usage shares and the next-token overlap (decode tokens,
    pooled over `traces`), and the stickiness that reproduces that overlap."""
    n_layers = traces[0]["routed"].shape[1]
    experts = int(traces[0]["num_experts"].max()) if "num_experts" in traces[0] else \
        int(max(t["routed"].max() for t in traces)) + 1
    k = traces[0]["routed"].shape[2]
    stats = []
    for l in range(n_layers):
        # sorted within each passage, then averaged by rank: a passage's own usage is
        # more skewed than the pooled usage of several (each topic has its experts)
        shares = np.mean([_sorted_shares(t["routed"][:, l], experts) for t in traces], axis=0)
        overlap = float(np.mean([_overlap(t["routed"][t["decode"].astype(bool), l])
                                 for t in traces]))
        s = LayerStats(shares, overlap)
        s.stick = _fit_stick(s, experts, k, seed=l)
        stats.append(s)
    return stats


def _stretched(shares: np.ndarray, experts: int) -> np.ndarray:
    """The sorted share curve over `experts` ranks (the same skew, every expert used)."""
    x = (np.arange(experts) + 0.5) / experts
    src = (np.arange(len(shares)) + 0.5) / len(shares)
    p = np.interp(x, src, shares)
    p = np.maximum(p, 1e-6)
    return p / p.sum()


def _sequence(p: np.ndarray, k: int, stick: float, tokens: int,
              rng: np.random.Generator) -> np.ndarray:
    """Draws without replacement in proportion to `p` (the Gumbel top-k trick: the k
    largest of log p + Gumbel noise), each token keeping each previous expert with
    probability `stick`."""
    experts = len(p)
    logp = np.log(p)
    noise = rng.gumbel(size=(tokens, experts))
    keep = rng.random((tokens, k)) < stick
    out = np.empty((tokens, k), dtype=np.int32)
    prev = None
    for t in range(tokens):
        score = logp + noise[t]
        kept = prev[keep[t]] if prev is not None else prev
        n_kept = 0 if kept is None else len(kept)
        if n_kept:
            score[kept] = -np.inf
        fresh = np.argpartition(-score, k - n_kept)[:k - n_kept] if n_kept < k else \
            np.zeros(0, dtype=np.int64)
        prev = np.concatenate([kept, fresh]) if n_kept else fresh
        out[t] = prev
    return out


def _fit_stick(s: LayerStats, experts: int, k: int, seed: int, tokens: int = 400) -> float:
    """The stickiness whose generated overlap is the measured one (it rises with the
    stickiness: bisection, to 1/128)."""
    p = _stretched(s.shares, experts)
    lo, hi = 0.0, 1.0
    for _ in range(STICK_STEPS):
        mid = (lo + hi) / 2
        got = _overlap(_sequence(p, k, mid, tokens, np.random.default_rng(seed)))
        lo, hi = (mid, hi) if got < s.overlap else (lo, mid)
    return (lo + hi) / 2


def generate(stats: List[LayerStats], like: Dict[str, np.ndarray], experts: int, top_k: int,
             layers: int, seed: int = 0) -> Dict[str, np.ndarray]:
    """A trace of `layers` layers of `experts` experts, top-`top_k`, with the token and call
    structure of trace `like` (its prompt, decode mask and forward calls)."""
    rng = np.random.default_rng(seed)
    tokens = len(like["routed"])
    routed = np.empty((tokens, layers, top_k), dtype=np.int32)
    for l in range(layers):
        s = stats[l * len(stats) // layers]
        p = _stretched(s.shares, experts)[rng.permutation(experts)]
        routed[:, l] = _sequence(p, top_k, s.stick, tokens, rng)
    out = {k: v for k, v in like.items() if not k.startswith("prefetch") and k != "model"}
    record = int(like["expert_bytes"][0]) if "expert_bytes" in like else 1
    out.update(routed=routed, layers=np.arange(layers, dtype=np.int32),
               num_experts=np.full(layers, experts, dtype=np.int32),
               expert_bytes=np.full(layers, record, dtype=np.int64))
    return out


def hit_rates(trace: Dict[str, np.ndarray], budgets: Sequence[str] = ("10%", "25%", "50%"),
              policies: Sequence[str] = ("lfu", "belady")) -> Dict[str, float]:
    """{"lfu@10%": decode hit rate, ...} of one trace replayed by edgemoe.whatif.replay
    (a policy by name, or a policy class: LRU is edgemoe.streaming.cache.Recency)."""
    from ..replay import simulate
    return {f"{getattr(pol, '__name__', pol).lower()}@{b}": simulate(trace, b, pol).decode_hit_rate
            for pol in policies for b in budgets}


def check(traces: Sequence[Dict[str, np.ndarray]], names: Sequence[str], seed: int = 0,
          policies: Sequence = ("lfu", "belady")) -> dict:
    """Leave one out: for each trace, routing generated from the others' statistics (same
    width, depth and token structure) against the held-out trace's own hit rates."""
    rows = []
    for i, (held, name) in enumerate(zip(traces, names)):
        stats = fit([t for j, t in enumerate(traces) if j != i])
        experts, k = int(held["num_experts"].max()), held["routed"].shape[2]
        gen = generate(stats, held, experts, k, held["routed"].shape[1], seed + i)
        real, synth = hit_rates(held, policies=policies), hit_rates(gen, policies=policies)
        rows.append({"held_out": name, "real": real, "generated": synth,
                     "diff_points": {key: 100 * (synth[key] - real[key]) for key in real}})
    keys = rows[0]["real"].keys()
    mean = {key: {"real": float(np.mean([r["real"][key] for r in rows])),
                  "generated": float(np.mean([r["generated"][key] for r in rows]))}
            for key in keys}
    for v in mean.values():
        v["diff_points"] = 100 * (v["generated"] - v["real"])
    return {"rows": rows, "mean": mean}


def native_geometry(shape, trace: Dict[str, np.ndarray]) -> bool:
    """True when the trace was recorded on this shape's geometry (experts, top-k, layers):
    then relabelling it (map_trace) replays real routing; otherwise generate."""
    routed = trace["routed"]
    experts = int(trace["num_experts"].max()) if "num_experts" in trace else int(routed.max()) + 1
    return (shape.experts, shape.top_k, shape.layers) == (experts, routed.shape[2], routed.shape[1])


def shape_routing(shape, traces: Sequence[Dict[str, np.ndarray]], seed: int = 0,
                  top_k: int = 0) -> List[Dict[str, np.ndarray]]:
    """Routing of `shape` (at `top_k`, default the shape's) for each of `traces`: their own
    routing relabelled where the geometry is theirs, else generated from their fitted
    statistics, with each trace's token structure and record size."""
    from .shapes import map_trace
    k = top_k or shape.top_k
    if k == shape.top_k and all(native_geometry(shape, t) for t in traces):
        return [map_trace(t, shape, seed=seed) for t in traces]
    stats = fit(traces)
    out = []
    for i, t in enumerate(traces):
        g = generate(stats, t, shape.experts, k, shape.layers, seed + i)
        g["expert_bytes"] = np.full(shape.layers, shape.record_bytes, dtype=np.int64)
        out.append(g)
    return out
