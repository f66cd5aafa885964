"""Fitting the learned cache policy (edgemoe.whatif.experimental.learned) to replays.

The features are those LearnedPolicy computes from the stream of uses at an eviction;
the target is each resident expert's (log) distance to its next use, which a replay of a
trace knows (edgemoe.whatif.replay). `python -m edgemoe.cache_sim train-learned` runs it.
"""

from typing import Dict, List

import numpy as np

from ...streaming.cache import Recency
from ..replay import Requests, layer_requests, next_steps, replay, trace_experts
from .learned import LearnedPolicy, NextUseModel

TARGET_CAP = 2048  # steps: next uses farther than this all count as "far"


class _Watched(Recency):
    """Evicts the least recent, and shows the same touches to a LearnedPolicy for its
    features."""

    def __init__(self):
        super().__init__()
        self.learned = LearnedPolicy()
        self.step = 0  # replay keeps it current
        self.last_step = {}  # expert -> the step of its last touch

    def touch(self, expert: int):
        super().touch(expert)
        self.learned.touch(expert)
        self.last_step[expert] = self.step


def training_rows(requests: Requests, slots: int, stride: int = 1):
    """(features, log steps to next use) of every expert seen so far, before every
    `stride`-th step: what LearnedPolicy's model is asked at an eviction. The touches
    come from a replay at `slots` (the store touches a miss twice), evicting the least
    recent."""
    nxt, watched, xs, ys = next_steps(requests.steps), _Watched(), [], []

    def record(i):
        if i % stride or not watched.last_step:
            return
        seen = list(watched.last_step)
        xs.append(watched.learned.features(seen))
        distance = np.array([nxt[watched.last_step[e], e] for e in seen]) - i + 1
        ys.append(np.log1p(np.minimum(distance, TARGET_CAP)))

    replay(requests, slots, watched, record)
    return np.concatenate(xs), np.concatenate(ys)


def fit(x: np.ndarray, y: np.ndarray, hidden: int = 16, steps: int = 2000,
        lr: float = 1e-2, seed: int = 0) -> NextUseModel:
    """A 2-layer tanh MLP, least squares, full-batch Adam."""
    rng = np.random.default_rng(seed)
    mean, std = x.mean(0), x.std(0) + 1e-6
    xn = (x - mean) / std
    params = [rng.normal(0, 1 / np.sqrt(x.shape[1]), (x.shape[1], hidden)), np.zeros(hidden),
              rng.normal(0, 1 / np.sqrt(hidden), hidden), np.array(y.mean())]
    moments = [(np.zeros_like(p), np.zeros_like(p)) for p in params]
    for t in range(1, steps + 1):
        w1, b1, w2, b2 = params
        h = np.tanh(xn @ w1 + b1)
        err = (h @ w2 + b2 - y) * (2 / len(y))
        dh = np.outer(err, w2) * (1 - h ** 2)
        grads = [xn.T @ dh, dh.sum(0), h.T @ err, err.sum()]
        for p, g, (m, v) in zip(params, grads, moments):
            m *= 0.9
            m += 0.1 * g
            v *= 0.999
            v += 0.001 * g ** 2
            p -= lr * (m / (1 - 0.9 ** t)) / (np.sqrt(v / (1 - 0.999 ** t)) + 1e-8)
    w1, b1, w2, b2 = params
    return NextUseModel(mean, std, w1, b1, w2, np.asarray(b2))


def train_learned(traces: List[Dict[str, np.ndarray]], max_rows: int = 20_000,
                  **fit_args) -> NextUseModel:
    xs, ys = [], []
    for trace in traces:
        routed, decode = trace["routed"], trace["decode"].astype(bool)
        num_experts = trace_experts(trace)
        for layer in range(routed.shape[1]):
            for slots in (num_experts // 8, num_experts // 4, num_experts // 2):
                slots = max(slots, routed.shape[-1])
                x, y = training_rows(layer_requests(routed, decode, layer, slots), slots)
                xs.append(x)
                ys.append(y)
    x, y = np.concatenate(xs), np.concatenate(ys)
    if len(x) > max_rows:
        keep = np.random.default_rng(0).choice(len(x), max_rows, replace=False)
        x, y = x[keep], y[keep]
    return fit(x, y, **fit_args)
