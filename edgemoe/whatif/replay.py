"""Routing traces replayed through the store's own slots, against Belady's optimum.

The replay runs the store's own slot state machine (edgemoe.streaming.slots.LayerSlots)
over a memory that holds nothing and a reader that finishes each fill as it is
submitted, so it cannot drift from what the store does: each forward call asks each
MoE layer for its distinct experts in passes that fit the pool (edgemoe.streaming.calls),
and with `prefetch` the prefetches the trace recorded are issued where they were, in
the layer call that issued them. Slot counts come from the store's rule
(edgemoe.streaming.budget). A trace records its forward calls; an older one without them
is replayed as mlx-lm prefills, in calls of at most 2048 prompt tokens.

Belady's optimum evicts the resident, unpinned expert whose next use in that layer is
farthest in the future: no policy has fewer loads on the same requests (without prefetch).

    simulate(trace, "10%", "lfu")  # one trace as one generation: a Result
    run(traces, budgets, policies)  # every policy at every budget, summed over the traces

edgemoe.cache_sim asks its questions with these (policies here; a split and speculative
windows in edgemoe.whatif.questions).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np

from ..format.pack import Pack, PackLayer
from ..format.records import Record, TensorLayout
from ..streaming import calls as calls_module
from ..streaming.budget import SlotPlan
from ..streaming.cache import make_policy
from .experimental.learned import LearnedPolicy, NextUseModel
from ..streaming.calls import passes
from ..streaming.memory import NoMemory
from ..streaming.stats import ExpertStats
from ..streaming.store import ExpertStore

PREFILL_CHUNK = 2048  # mlx-lm generate_step's prefill_step_size


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


def recorded_prefetches(trace) -> Dict[tuple, list]:
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
    elif policy == "learned":  # its weights: `model`, else the file `learned`
        factory = lambda: LearnedPolicy(model) if model is not None \
            else LearnedPolicy.from_file(learned)  # noqa: E731
    else:
        factory = lambda: make_policy(policy)  # noqa: E731
    pack = replay_pack(plan.expert_bytes, plan.num_experts, plan.top_k)
    store = replay_store(pack, slots, factory)
    store.gate_prefetches(prefetch and bool(trace.get("prefetch_gated", False)))
    pools = [store.pool(i) for i in range(routed.shape[1])]
    steps = [0] * len(pools)  # Belady's position in each layer's requests
    ahead = recorded_prefetches(trace) if prefetch else {}
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
