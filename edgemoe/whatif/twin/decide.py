"""The defaults a machine profile gets, decided from the twin's figures.

edgemoe.machines holds the defaults the code uses; this module derives the ones the twin
can judge from its rows (scripts/bench_twin.py --json, on the qwen3-30b-a3b shape at 10%
and 25%: the model most users stream), and tests/test_twin.py checks the two agree for
every profile the rows cover:

    readers            the fewest reader threads within 3% of the best native decode at
                       every budget (more threads cost Python; reads queue at the SSD)
    routing            advisory where it beats native by 3% at every budget, else native
    prefill_step_size  the prefill chunk with the lowest TTFT limit for a 4096-token prompt
                       at 25% (each chunk reads the experts it needs once; fewer chunks,
                       fewer reads); a tie within 3% goes to the smaller chunk

Two defaults are not the twin's to judge, and stay as edgemoe.machines says why: the I/O
mode (direct on a Mac: buffered reads would hold every record a second time in the page
cache, in the same unified memory the slots live in), and the cache policy (LFU: the
bytes of a replay do not depend on the machine; docs/cache.md).
"""

from typing import Dict, List, Optional

from ...routing.modes import routing_mode
from ...streaming.budget import SlotPlan, parse_budget
from .forecast import ttft_forecast
from .profiles import load_profile
from .shapes import SHAPES

TOLERANCE = 0.03
SHAPE = "qwen3-30b-a3b"
CHUNKS = (512, 1024, 2048, 4096)
PROMPT = 4096


def _by(rows: List[dict], **match) -> List[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def decide_readers(rows: List[dict], profile: str) -> int:
    native = _by(rows, profile=profile, mode="native")
    budgets = sorted({r["budget"] for r in native})
    counts = sorted({r["readers"] for r in native})
    best = {b: max(r["forecast_decode_tok_s"] for r in _by(native, budget=b)) for b in budgets}
    for n in counts:
        if all(_by(native, budget=b, readers=n)[0]["forecast_decode_tok_s"]
               >= (1 - TOLERANCE) * best[b] for b in budgets):
            return n
    return counts[-1]


def decide_routing(rows: List[dict], profile: str, readers: int) -> str:
    budgets = sorted({r["budget"] for r in _by(rows, profile=profile, mode="advisory")})
    pays = budgets and all(
        _by(rows, profile=profile, mode="advisory", budget=b)[0]["forecast_decode_tok_s"]
        > (1 + TOLERANCE) * _by(rows, profile=profile, mode="native", budget=b,
                                readers=readers)[0]["forecast_decode_tok_s"]
        for b in budgets)
    return "advisory" if pays else "native"


def prefill_limits(profile: str, budget: str = "25%") -> Dict[int, float]:
    """{chunk: the TTFT limit of a 4096-token prompt} on `profile`, the deciding shape."""
    shape = SHAPES[SHAPE]
    plan = SlotPlan(tuple([shape.record_bytes] * shape.layers),
                    tuple([shape.experts] * shape.layers), shape.top_k)
    slots = plan.slots_for_bytes(parse_budget(budget, plan.total_bytes))
    return {c: ttft_forecast(shape, load_profile(profile), PROMPT, slots, c) for c in CHUNKS}


def decide_prefill_step(ttft_limits: Dict[int, float]) -> int:
    """{chunk: TTFT limit of the 4096-token prompt} -> the chunk to prefill in."""
    best = min(ttft_limits.values())
    return min(c for c, t in ttft_limits.items() if t <= (1 + TOLERANCE) * best)


def decide(rows: List[dict], profile: str) -> dict:
    """The defaults the twin's `rows` (and the TTFT limits) give `profile`."""
    readers = decide_readers(rows, profile)
    return {"readers": readers, "routing": decide_routing(rows, profile, readers),
            "prefill_step_size": decide_prefill_step(prefill_limits(profile))}


def with_sync_model(rows: List[dict], layers: int = 48, old_sync_us: float = 100.0,
                    syncs_per_layer: Optional[tuple] = None) -> List[dict]:
    """The twin's rows (made when a host sync was an unsourced 100 us and nothing else, on
    a path that synced native and advisory twice a layer and prerouted once) as the
    host-sync model has them: each synced layer pays the profile's read-back (host_sync_us)
    and one GPU idle (sync_idle_us). Today's path (edgemoe.mlx_backend.hostsync) syncs native and
    advisory once a streamed layer, prerouted decode once a token, and every token once
    more; `syncs_per_layer=(2, 1)` gives the path before it. The weights'
    compute follows the profile's int4 rate now (the M4's changed: BigRig's kernels): the
    native row's compute less its syncs was the shape's active bytes at the rate it was
    made with. The waits add to the token; reads in flight keep running through them, so
    the bytes and the blocked time stay."""
    shape = SHAPES[SHAPE]
    out = []
    for r in rows:
        p = load_profile(r["profile"])
        native = _by(rows, profile=r["profile"], mode="native", budget=r["budget"])[0]
        weights_then = native["compute_ms_per_token"] - (2 * layers + 1) * old_sync_us / 1e3
        weights_now = 1e3 * shape.active_bytes_per_token / (p.value("int4_gbps") * 1e9)
        host, idle = p.value("host_sync_us"), p.value("sync_idle_us")
        prerouted = routing_mode(r["mode"]).routes  # its routing known a token ahead
        then_us = ((1 if prerouted else 2) * layers + 1) * old_sync_us
        if syncs_per_layer is None:  # today's path: a sync a streamed layer, prerouted a token
            now_us = (1 if prerouted else layers) * (host + idle) + host
        else:  # (native, prerouted) syncs a layer, each layer paying one GPU idle
            n = syncs_per_layer[1 if prerouted else 0]
            now_us = layers * (n * host + idle) + host
        added_us = now_us - then_us
        added_s = added_us * 1e-6 + (weights_now - weights_then) * 1e-3
        row = dict(r)
        row["forecast_decode_tok_s"] = 1 / (1 / r["forecast_decode_tok_s"] + added_s)
        row["sync_model_added_ms"] = 1e3 * added_s
        out.append(row)
    return out
