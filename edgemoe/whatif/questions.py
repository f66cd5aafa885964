"""The expert cache's what-if questions beyond a replay of the policies (the command line:
edgemoe.cache_sim).

`split` asks whether one budget shared across layers beats the even split the store uses:
it fits a split of the same slot total to the first half of the traces (slots go one at a
time to the layer whose loads they cut most) and replays the other half with both splits.

`windows` asks what speculative decoding can save in reads at best: the decoded tokens
verified in windows, every draft kept, each window one call over the union of its
tokens' experts (a draft that is sometimes wrong reads more).
"""

from typing import Dict, List

import numpy as np

from ..streaming.cache import make_policy
from .replay import layer_requests, replay, simulate, trace_calls, trace_plan


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
