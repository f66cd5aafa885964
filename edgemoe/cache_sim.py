"""Replay routing traces through the expert cache policies, against Belady's optimum.

    python -m edgemoe.cache_sim replay TRACE [TRACE ...] --budget 0.1,0.25,0.5 \\
        [--policies lru,lfu,lfuda,s3fifo,learned] [--prefetch] [--png hit_rate.png] [--json out.json]
    python -m edgemoe.cache_sim train-learned TRACE [TRACE ...] --out cache_policy.npz
    python -m edgemoe.cache_sim split TRACE [TRACE ...] --budget 0.1,0.25 [--policy lfu]
    python -m edgemoe.cache_sim windows TRACE [TRACE ...] --budget 0.1,0.25 --window 1,2,4,8

Each subcommand has its own --help; `replay` is the default (`cache_sim TRACE --budget 0.1`).

The replay runs the store's own slot state machine (edgemoe.streaming.slots.LayerSlots)
over a memory that holds nothing and a reader that finishes each fill as it is
submitted, so it cannot drift from what the store does: each forward call asks each
MoE layer for its distinct experts in passes that fit the pool (edgemoe.streaming.calls),
and with `--prefetch` the prefetches the trace recorded are issued where they were, in
the layer call that issued them. Slot counts come from the store's rule
(edgemoe.streaming.budget). A trace records its forward calls; an older one without them
is replayed as mlx-lm prefills, in calls of at most 2048 prompt tokens.

`windows` asks what speculative decoding can save in reads at best: the decoded tokens
verified in windows, every draft kept, each window one call over the union of its
tokens' experts (a draft that is sometimes wrong reads more).

`split` asks whether one budget shared across layers beats the even split the store uses:
it fits a split of the same slot total to the first half of the traces (slots go one at a
time to the layer whose loads they cut most) and replays the other half with both splits.

Belady's optimum evicts the resident, unpinned expert whose next use in that layer is
farthest in the future: no policy has fewer loads on the same requests (without prefetch).
"""

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from .cli import add_debug_flag, tool
from .format.pack import Pack, PackLayer, Record, TensorLayout
from .streaming.budget import SlotPlan
from .streaming.cache import (DEFAULT_LEARNED, POLICIES, LearnedPolicy, LRUPolicy, NextUseModel,
                              make_policy)
from .streaming import calls as calls_module
from .streaming.calls import passes
from .streaming.stats import ExpertStats
from .streaming.store import ExpertStore
from .streaming.slots import NoMemory
from .streaming.trace import load_trace

PREFILL_CHUNK = 2048  # mlx-lm generate_step's prefill_step_size
TARGET_CAP = 2048  # steps: next uses farther than this all count as "far"


def forward_calls(decode: np.ndarray) -> List[slice]:
    """The token ranges of the model's forward calls, for a trace that did not record
    them: each decoded token alone, each run of prompt tokens in chunks of PREFILL_CHUNK."""
    calls, start = [], None  # start: first token of the prompt run being chunked
    for t, decoded in enumerate(decode.tolist()):
        if decoded:
            if start is not None:
                calls.append(slice(start, t))
                start = None
            calls.append(slice(t, t + 1))
        elif start is None:
            start = t
        elif t - start == PREFILL_CHUNK:
            calls.append(slice(start, t))
            start = t
    if start is not None:
        calls.append(slice(start, len(decode)))
    return calls


def trace_calls(trace: Dict[str, np.ndarray]) -> List[slice]:
    if "calls" not in trace:
        return forward_calls(trace["decode"].astype(bool))
    ends = np.cumsum(trace["calls"]).tolist()
    return [slice(a, b) for a, b in zip([0] + ends[:-1], ends)]


class InstantReader:
    """A reader that finishes every fill as it is submitted, reading nothing."""

    io = "none"
    busy_s = verify_s = 0.0

    def submit(self, fills):
        for f in fills:
            f.on_done(f, f.record.length, None)

    def alive(self) -> bool:
        return True

    def close(self):
        pass


def replay_pack(expert_bytes, num_experts, top_k: int, layers=None) -> Pack:
    """A Pack of records that hold nothing, shaped as a trace's layers."""
    layers = list(range(len(expert_bytes))) if layers is None else list(layers)
    pack_layers = []
    for index, nbytes, n in zip(layers, expert_bytes, num_experts):
        nbytes, n = int(nbytes), int(n)
        tensors = [TensorLayout("expert.weight", "uint8", (nbytes,), 0, nbytes)]
        records = [Record(((0, e * nbytes, nbytes),)) for e in range(n)]
        pack_layers.append(PackLayer(f"layers.{index}", int(index), tensors, {}, records))
    return Pack(Path("<trace>"), "trace", top_k, pack_layers, 0)


def replay_store(pack: Pack, slots: int, policy) -> ExpertStore:
    """An ExpertStore of `slots` per layer over nothing; `policy` as ExpertStore takes it."""
    return ExpertStore(pack, slots * SlotPlan.of(pack).slot_bytes, policy,
                       memory=lambda layer, n: NoMemory(),
                       reader=InstantReader())


@dataclass
class Requests:
    """What one layer's pool is asked for, in order: sets of experts needed together."""

    steps: List[np.ndarray]
    decode: np.ndarray  # bool per step


def layer_requests(routed: np.ndarray, decode: np.ndarray, layer: int, slots: int,
                   calls: Optional[List[slice]] = None) -> Requests:
    steps, flags = [], []
    for call in calls or forward_calls(decode):
        for group in passes(np.unique(routed[call, layer]), slots):
            steps.append(group)
            flags.append(bool(decode[call.start]))
    return Requests(steps, np.array(flags, dtype=bool))


def next_steps(steps: List[np.ndarray]) -> Dict[tuple, float]:
    """(step, expert) -> the index of the expert's next step, inf if none."""
    nxt, later = {}, {}
    for i in range(len(steps) - 1, -1, -1):
        for e in steps[i].tolist():
            nxt[i, e] = later.get(e, np.inf)
            later[e] = i
    return nxt


class BeladyPolicy:
    """Evict the expert whose next use is farthest in the future. Offline: it is given
    the requests, and the replay keeps its `step` at the one being served."""

    def __init__(self, steps: List[np.ndarray]):
        self._next = next_steps(steps)
        self.step = 0
        self._next_use = {}  # expert touched and not forgotten -> its next step

    def touch(self, expert: int):
        self._next_use[expert] = self._next[self.step, expert]

    def forget(self, expert: int):
        self._next_use.pop(expert, None)

    def victim(self, pinned) -> Optional[int]:
        pinned = set(pinned)
        candidates = [e for e in self._next_use if e not in pinned]
        return max(candidates, key=self._next_use.__getitem__, default=None)


def replay(requests: Requests, slots: int, policy,
           on_step: Optional[Callable[[int], None]] = None) -> np.ndarray:
    """(hits, loads) per step of one layer, through the store's state machine.
    `on_step(i)` is called before step i is served."""
    offline = hasattr(policy, "step")  # told where in the requests it is
    num_experts = max((int(s.max()) + 1 for s in requests.steps if len(s)), default=1)
    store = replay_store(replay_pack([4096], [max(num_experts, slots)], 1), slots,
                         lambda: policy)
    pool, stats = store.pool(0), store.stats
    counts = np.zeros((len(requests.steps), 2), dtype=np.int64)
    for i, experts in enumerate(requests.steps):
        if offline:
            policy.step = i
        if on_step is not None:
            on_step(i)
        hits, loads = stats.hits, stats.loads
        pool.ensure(experts)
        pool.release()
        counts[i] = stats.hits - hits, stats.loads - loads
    return counts


@dataclass
class Result:
    policy: str
    budget: str
    slots: int
    hits: int = 0
    on_demand: int = 0
    loads: int = 0  # every fill: on demand and prefetched
    prefetches: int = 0
    evictions: int = 0
    bytes_read: int = 0
    decode_hits: int = 0
    decode_on_demand: int = 0
    decode_loads: int = 0
    decode_bytes_read: int = 0
    decode_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / max(self.hits + self.on_demand, 1)

    @property
    def decode_hit_rate(self) -> float:
        return self.decode_hits / max(self.decode_hits + self.decode_on_demand, 1)

    def add(self, other: "Result"):
        for k in ("hits", "on_demand", "loads", "prefetches", "evictions", "bytes_read",
                  "decode_hits", "decode_on_demand", "decode_loads", "decode_bytes_read",
                  "decode_tokens"):
            setattr(self, k, getattr(self, k) + getattr(other, k))

    def count(self, delta: ExpertStats, decode: bool):
        self.hits += delta.hits
        self.on_demand += delta.on_demand
        self.loads += delta.loads
        self.prefetches += delta.prefetches
        self.evictions += delta.evictions
        self.bytes_read += delta.bytes_read
        if decode:
            self.decode_hits += delta.hits
            self.decode_on_demand += delta.on_demand
            self.decode_loads += delta.loads
            self.decode_bytes_read += delta.bytes_read


def trace_experts(trace: Dict[str, np.ndarray]) -> int:
    """Experts per layer: recorded in the trace, or (older traces) the largest id + 1."""
    if "num_experts" in trace:
        return int(trace["num_experts"].min())
    return int(trace["routed"].max()) + 1


def trace_plan(trace: Dict[str, np.ndarray], num_experts: Optional[int] = None) -> SlotPlan:
    n_layers = trace["routed"].shape[1]
    counts = ([int(num_experts)] * n_layers if num_experts else
              trace["num_experts"].tolist() if "num_experts" in trace
              else [trace_experts(trace)] * n_layers)
    return SlotPlan(tuple(trace["expert_bytes"].astype(np.int64).tolist()), tuple(counts),
                    trace["routed"].shape[-1])


def _prefetches(trace) -> Dict[tuple, list]:
    """(call, issuing layer position) -> [(target position, lead, experts)], in order."""
    found: Dict[tuple, list] = {}
    if "prefetch_at" not in trace:
        return found
    experts = np.split(trace["prefetch_experts"], np.cumsum(trace["prefetch_counts"])[:-1])
    for (call, source, target, lead), ids in zip(trace["prefetch_at"].tolist(), experts):
        found.setdefault((call, source), []).append((target, lead, ids))
    return found


def simulate(trace: Dict[str, np.ndarray], budget, policy: str,
             num_experts: Optional[int] = None, model: Optional[NextUseModel] = None,
             prefetch: bool = False, learned: Optional[Path] = None) -> Result:
    """Replay one trace through a fresh store, as one generation: every layer's calls in
    the order the model made them, and with `prefetch` the recorded prefetches too."""
    routed, decode = trace["routed"], trace["decode"].astype(bool)
    plan = trace_plan(trace, num_experts)
    slots = plan.slots(budget)
    calls = trace_calls(trace)
    if prefetch and policy == "belady":
        raise ValueError("belady replays demand loads only; drop --prefetch for it")
    if policy == "belady":
        per_layer = [layer_requests(routed, decode, i, slots, calls).steps
                     for i in range(routed.shape[1])]
        policies = iter([BeladyPolicy(steps) for steps in per_layer])
        factory = lambda: next(policies)  # noqa: E731 (one per layer, in layer order)
    elif policy == "learned" and model is not None:
        factory = lambda: LearnedPolicy(model)  # noqa: E731
    else:
        factory = lambda: make_policy(policy, learned)  # noqa: E731
    pack = replay_pack(plan.expert_bytes, plan.num_experts, plan.top_k)
    store = replay_store(pack, slots, factory)
    store.gate_prefetches(prefetch and bool(trace.get("prefetch_gated", False)))
    pools = [store.pool(i) for i in range(routed.shape[1])]
    steps = [0] * len(pools)  # Belady's position in each layer's requests
    ahead = _prefetches(trace) if prefetch else {}
    result = Result(policy, str(budget), slots, decode_tokens=int(decode.sum()))

    def issue(call, position):
        for target, lead, ids in ahead.get((call, position), ()):
            store.prefetch(target, ids, lead)

    for c, call in enumerate(calls):
        before = store.snapshot()
        issue(c, -1)
        for position, pool in enumerate(pools):
            groups = passes(np.unique(routed[call, position]), slots)
            for g, group in enumerate(groups):
                if policy == "belady":
                    pool.policy.step = steps[position]
                    steps[position] += 1
                pool.ensure(group, new_call=g == 0)
                if calls_module.READ_AHEAD and g + 1 < len(groups):  # as run_call does
                    if policy == "belady":  # what it reads is the next step's
                        pool.policy.step = steps[position]
                    pool.read_ahead(groups[g + 1])
                if g == 0:
                    issue(c, position)
                pool.release()
        result.count(store.snapshot() - before, bool(decode[call.start]))
    return result


def run(traces: List[Dict[str, np.ndarray]], budgets: List[str], policies: List[str],
        num_experts: Optional[int] = None, model: Optional[NextUseModel] = None,
        prefetch: bool = False, learned: Optional[Path] = None) -> List[Result]:
    """Every policy at every budget, summed over the traces."""
    results = []
    for budget in budgets:
        for policy in policies:
            total = None
            for trace in traces:
                r = simulate(trace, budget, policy, num_experts, model, prefetch, learned)
                if total is None:
                    total = r
                else:
                    total.add(r)
            results.append(total)
    return results


# -- the learned policy: features from the stream of uses, targets from the future --

class _Watched(LRUPolicy):
    """Evicts by LRU, and shows the same touches to a LearnedPolicy for its features."""

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
    come from a replay at `slots` (the store touches a miss twice), evicting by LRU."""
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


# -- a budget shared across layers --

def decode_bytes(traces: List[Dict[str, np.ndarray]], layer: int, slots: int,
                 policy: str) -> int:
    """Expert bytes one layer's pool of `slots` reads for decoded tokens, over the traces."""
    total = 0
    for trace in traces:
        decode = trace["decode"].astype(bool)
        requests = layer_requests(trace["routed"], decode, layer, slots, trace_calls(trace))
        loads = replay(requests, slots, make_policy(policy))[:, 1]
        total += int(loads[requests.decode].sum()) * int(trace["expert_bytes"][layer])
    return total


def fit_split(traces: List[Dict[str, np.ndarray]], total: int, policy: str) -> List[int]:
    """Slots per layer, `total` in all (at least top-k each): each slot goes to the layer
    whose decode bytes it cuts most on these traces."""
    plan = trace_plan(traces[0])
    layers = range(len(plan.num_experts))
    split = [plan.top_k] * len(plan.num_experts)
    cost = {}

    def bytes_at(layer, slots):
        if (layer, slots) not in cost:
            cost[layer, slots] = decode_bytes(traces, layer, slots, policy)
        return cost[layer, slots]

    while sum(split) < total:
        open_layers = [l for l in layers if split[l] < plan.num_experts[l]]
        if not open_layers:
            break
        best = max(open_layers, key=lambda l: bytes_at(l, split[l]) - bytes_at(l, split[l] + 1))
        split[best] += 1
    return split


def compare_split(traces: List[Dict[str, np.ndarray]], budget, policy: str) -> dict:
    """The even split against one fitted to the first half of `traces`, replayed on the
    second half (held out from the fit): decode bytes per token of each."""
    if len(traces) < 2:
        raise ValueError("split needs at least 2 traces: it fits on half and tests on the rest")
    fit_on, held_out = traces[:len(traces) // 2], traces[len(traces) // 2:]
    even = trace_plan(traces[0]).slots(budget)
    layers = traces[0]["routed"].shape[1]
    split = fit_split(fit_on, even * layers, policy)
    tokens = sum(int(t["decode"].sum()) for t in held_out)
    per_token = {name: sum(decode_bytes(held_out, l, slots[l], policy)
                           for l in range(layers)) / max(tokens, 1)
                 for name, slots in (("even", [even] * layers), ("fitted", split))}
    return {"budget": str(budget), "policy": policy, "even_slots": even, "split": split,
            "fit_traces": len(fit_on), "held_out_traces": len(held_out),
            "even_bytes_per_token": per_token["even"],
            "fitted_bytes_per_token": per_token["fitted"]}


# -- speculative windows --

def windowed(trace: Dict[str, np.ndarray], window: int) -> Dict[str, np.ndarray]:
    """`trace` with its decoded tokens verified `window` at a time, every draft kept: each
    window one forward call over the union of its tokens' experts (speculative decoding's
    best case for reads); prompt calls as recorded."""
    decode = trace["decode"].astype(bool)
    sizes, run = [], 0
    for call in trace_calls(trace):
        if not decode[call.start]:
            if run:
                sizes.append(run)
                run = 0
            sizes.append(call.stop - call.start)
            continue
        run += call.stop - call.start
        if run >= window:
            sizes.append(run)
            run = 0
    if run:
        sizes.append(run)
    return dict(trace, calls=np.array(sizes))


def compare_windows(traces: List[Dict[str, np.ndarray]], budget, windows: List[int],
                    policy: str) -> List[dict]:
    """Decode bytes per token with the tokens verified in windows of each size, against
    one token a call (plain decode), at one budget."""
    rows = []
    for window in windows:
        results = [simulate(windowed(t, window), budget, policy) for t in traces]
        tokens = sum(r.decode_tokens for r in results)
        rows.append({"budget": str(budget), "policy": policy, "window": window,
                     "slots": results[0].slots,
                     "bytes_per_token": sum(r.decode_bytes_read for r in results) / max(tokens, 1)})
    plain = next((r["bytes_per_token"] for r in rows if r["window"] == 1), None)
    if plain is None:
        plain = compare_windows(traces, budget, [1], policy)[0]["bytes_per_token"]
    for r in rows:
        r["ratio_to_plain"] = r["bytes_per_token"] / plain if plain else 1.0
    return rows


# -- command line --

def plot(results: List[Result], path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r.policy for r in results):
        rows = [r for r in results if r.policy == policy]
        ax.plot([r.slots for r in rows], [r.decode_hit_rate for r in rows], marker="o",
                label=policy, linestyle="--" if policy == "belady" else "-")
    ax.set_xlabel("expert slots per layer (the budget)")
    ax.set_ylabel("decode hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def print_table(results: List[Result]):
    belady = {r.budget: r for r in results if r.policy == "belady"}
    print(f"{'budget':>7} {'slots':>5} {'policy':>8} {'hit rate':>9} {'decode hit':>10} "
          f"{'MB read/decode token':>21} {'vs Belady':>10}")
    for r in results:
        best = belady.get(r.budget)
        gap = f"{100 * (r.decode_hit_rate - best.decode_hit_rate):+.1f} pt" if best else ""
        per_token = r.decode_bytes_read / max(r.decode_tokens, 1) / 1e6
        print(f"{r.budget:>7} {r.slots:>5} {r.policy:>8} {r.hit_rate:>9.1%} "
              f"{r.decode_hit_rate:>10.1%} {per_token:>21.3f} {gap:>10}")


SUBCOMMANDS = ("replay", "split", "windows", "train-learned")


def build_parser() -> argparse.ArgumentParser:
    """`python -m edgemoe.cache_sim COMMAND ...`: one subcommand per question, each with
    its own --help. Without a subcommand the arguments are `replay`'s, as they were before
    there were subcommands (`cache_sim TRACE.npz --budget 0.1`)."""
    p = argparse.ArgumentParser(
        prog=sys.argv[0] if sys.argv[0].startswith("edgemoe ") else "python -m edgemoe.cache_sim",
        description="Replay routing traces (edgemoe.generate --trace) through the store's "
                    "expert slots: cache policies against Belady's optimum, a budget split "
                    "across layers, speculative windows; fit the learned policy.",
        epilog="Without a subcommand, replay: python -m edgemoe.cache_sim TRACE.npz "
               "--budget 0.1,0.25")
    add_debug_flag(p)
    sub = p.add_subparsers(dest="command", title="subcommands", metavar="COMMAND")
    replay = sub.add_parser(
        "replay", help="decode hit rates and bytes of each cache policy and Belady's optimum",
        description="Replay routing traces through expert cache policies and Belady's "
                    "optimum.", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    replay.add_argument("traces", nargs="+", help=".npz traces from `edgemoe.generate --trace`")
    replay.add_argument("--budget", default="0.1,0.25,0.5",
                        help="Comma-separated expert budgets: fractions, percentages or sizes")
    replay.add_argument("--policies", default=None,
                        help=f"Comma-separated, of {', '.join(POLICIES)}, belady "
                             f"(default: all; learned only if its weights exist)")
    replay.add_argument("--learned", default=str(DEFAULT_LEARNED), help="Learned policy weights")
    replay.add_argument("--num-experts", type=int, default=None,
                        help="Experts per layer (default: as the traces record)")
    replay.add_argument("--prefetch", action="store_true",
                        help="Also replay the prefetches the traces recorded (advisory or "
                             "prerouted runs); Belady is then left out")
    replay.add_argument("--png", default=None,
                        help="Plot decode hit rate against budget here (needs matplotlib: "
                             "pip install 'edgemoe[bench]')")
    replay.add_argument("--json", default=None, help="Write the results here")
    add_debug_flag(replay)
    replay.set_defaults(run=main_replay)

    split = sub.add_parser(
        "split", help="would one budget shared across layers beat the even split?",
        description="Fit a split of the slots across layers to half of the traces; replay "
                    "the other half with it and with the even split.")
    _replay_flags(split)
    split.set_defaults(run=main_split)

    windows = sub.add_parser(
        "windows", help="decode bytes per token in speculative windows, every draft kept",
        description="Decode bytes per token were the traces' decoded tokens verified in "
                    "speculative windows, every draft kept: the best a draft can do for "
                    "reads.")
    _replay_flags(windows)
    windows.add_argument("--window", default="1,2,3,4,6,8", help="tokens per window")
    windows.set_defaults(run=main_windows)

    train = sub.add_parser(
        "train-learned", help="fit the learned cache policy's weights",
        description="Fit the learned cache policy to Belady's next-use distances on routing "
                    "traces.")
    train.add_argument("traces", nargs="+")
    train.add_argument("--out", default=str(DEFAULT_LEARNED))
    train.add_argument("--hidden", type=int, default=16)
    train.add_argument("--steps", type=int, default=2000)
    add_debug_flag(train)
    train.set_defaults(run=main_train)
    return p


def _replay_flags(p: argparse.ArgumentParser):
    """The flags `split` and `windows` share."""
    p.add_argument("traces", nargs="+")
    p.add_argument("--budget", default="0.1,0.25")
    p.add_argument("--policy", default="lfu", choices=[n for n in POLICIES if n != "learned"])
    p.add_argument("--json", default=None, help="Write the results here")
    add_debug_flag(p)


@tool("cache_sim")
def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] not in SUBCOMMANDS and not argv[0].startswith("-"):
        argv = ["replay"] + argv  # the invocation from before the subcommands
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        parser.exit(2)
    return args.run(args)


def main_replay(args):
    traces = [load_trace(t) for t in args.traces]
    if args.policies:
        policies = args.policies.split(",")
    else:
        policies = [n for n in POLICIES if n != "learned" or Path(args.learned).exists()]
        if not args.prefetch:
            policies.append("belady")
    unknown = set(policies) - set(POLICIES) - {"belady"}
    if unknown:
        raise ValueError(f"cache policy {', '.join(sorted(unknown))}: choose from "
                         f"{', '.join(POLICIES)}, belady")
    model = NextUseModel.load(args.learned) if "learned" in policies else None
    results = run(traces, args.budget.split(","), policies, args.num_experts, model,
                  args.prefetch)
    n = sum(len(t["routed"]) for t in traces)
    d = sum(int(t["decode"].sum()) for t in traces)
    experts = args.num_experts or max(trace_experts(t) for t in traces)
    print(f"{len(traces)} traces, {n} tokens ({d} decoded), {experts} experts per layer, "
          f"top-{traces[0]['routed'].shape[-1]}" + (", prefetches replayed" if args.prefetch
                                                    else ""))
    print_table(results)
    if args.json:  # before the plot, which needs an optional package
        rows = [dict(asdict(r), hit_rate=r.hit_rate, decode_hit_rate=r.decode_hit_rate)
                for r in results]
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")
    if args.png:
        try:
            plot(results, args.png)
        except ImportError:
            sys.exit("edgemoe.cache_sim: error: --png needs matplotlib: "
                     "pip install 'edgemoe[bench]'")
        print(f"wrote {args.png}")


def main_train(args):
    traces = [load_trace(t) for t in args.traces]
    model = train_learned(traces, hidden=args.hidden, steps=args.steps)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    print(f"wrote {args.out} (trained on {len(traces)} traces)")


def main_split(args):
    traces = [load_trace(t) for t in args.traces]
    rows = [compare_split(traces, b, args.policy) for b in args.budget.split(",")]
    print(f"fitted on {rows[0]['fit_traces']} traces, replayed on {rows[0]['held_out_traces']} "
          f"others ({args.policy})")
    print(f"{'budget':>7} {'even slots':>10} {'fitted split':>24} {'KB/token even':>14} "
          f"{'KB/token fitted':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['budget']:>7} {r['even_slots']:>10} {str(r['split']):>24} "
              f"{r['even_bytes_per_token'] / 1e3:>14.1f} {r['fitted_bytes_per_token'] / 1e3:>16.1f} "
              f"{r['fitted_bytes_per_token'] / max(r['even_bytes_per_token'], 1):>6.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


def main_windows(args):
    traces = [load_trace(t) for t in args.traces]
    windows = [int(w) for w in args.window.split(",")]
    rows = [r for b in args.budget.split(",")
            for r in compare_windows(traces, b, windows, args.policy)]
    print(f"{len(traces)} traces, {sum(int(t['decode'].sum()) for t in traces)} decoded "
          f"tokens ({args.policy}); every draft kept")
    print(f"{'budget':>7} {'slots':>5} {'window':>6} {'KB/token':>9} {'vs plain':>8}")
    for r in rows:
        print(f"{r['budget']:>7} {r['slots']:>5} {r['window']:>6} "
              f"{r['bytes_per_token'] / 1e3:>9.1f} {r['ratio_to_plain']:>8.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
