"""doctor --machine PROFILE: whether a model fits a Mac, and a FORECAST of its speed there.

The forecast is analytic, labelled so, and uses the twin's own parts: the profile's
compute (edgemoe.whatif.twin.compute.Compute), the bytes a decode token reads at each budget from
edgemoe.cache_sim's replay of a routing trace mapped onto the model's shape
(edgemoe.whatif.twin.routing_gen.shape_routing: the bundled model's teacher-forced traces, or
--trace, relabelled where the shape has their geometry, else routing generated per layer
from their fitted statistics, so a 256-expert shape uses all of its experts and a 48-layer
one has distinct layers), and the profile's SSD. Per decode token:

    native (exact)   compute + host syncs + bytes / SSD rate       (reads wait, no overlap)
    exact limit      max(compute, Belady's bytes / SSD rate)       (the best exact routing allows)
    prerouted        max(compute + syncs, bytes / SSD rate)        (reads a token ahead)

Host syncs as profiles.json models them: per synced layer the read-back (host_sync_us) and
the GPU idle while the host builds the layer's next work (sync_idle_us). Native syncs once
a streamed layer (its routing read; a layer held whole looks its slots up on the device and
syncs none), prerouted once a token (edgemoe.mlx_backend.hostsync); `syncs_per_layer=(2, 1)`
forecasts the path before it (native twice a layer, prerouted once). The exact limit
assumes a design with no per-layer sync.

Prefill (TTFT) of a P-token prompt in chunks of C: per chunk, every expert the chunk needs
read once (the routed experts of a layer, at most all of them) and computed, overlapped:
max(compute, reads). The twin (scripts/bench_twin.py) runs the real pipeline for the
same questions; neither is validated against a Mac.
"""

import json
from pathlib import Path
from typing import List, Optional

from ...streaming.budget import (AUTO_KV_TOKENS, BudgetError, SlotPlan, auto_budget_bytes,
                                fmt_bytes, parse_budget)
from ...machines import DEFAULTS, GENERIC, machine_defaults
from .compute import Compute
from .profiles import Profile, load_profile
from .routing_gen import native_geometry, shape_routing
from .shapes import SHAPES, Shape, shape_from_config

DEFAULT_TRACES = Path(__file__).resolve().parents[2] / "models" / "fine" / "traces"  # shipped
METHOD = ("FORECAST (analytic, unvalidated on a Mac): profile compute + cache_sim's bytes of "
          "a routing trace's (relabelled or generated for the shape) / the profile's SSD rate")


def shape_for(model: str) -> Shape:
    """A twin shape by name, or the shape of a folder's (or a hub id's) config.json."""
    if model in SHAPES:
        return SHAPES[model]
    from ...hub import parse_hub_id
    hub_id = parse_hub_id(model)
    if hub_id is not None:
        import tempfile
        from ...hub import remote_headers
        with tempfile.TemporaryDirectory(prefix="edgemoe-forecast-") as tmp:
            remote = remote_headers(hub_id, Path(tmp) / "model")
            config = json.loads((remote.folder / "config.json").read_text())
        return shape_from_config(config, str(hub_id))
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if config.exists():
        return shape_from_config(json.loads(config.read_text()), path.name)
    raise ValueError(f"--machine: {model}: name a twin shape ({', '.join(SHAPES)}) or a "
                     f"folder with a config.json")


def decode_forecast(shape: Shape, profile: Profile, budget, traces: List[dict],
                    readers: int = 2, policy: str = "lfu",
                    mapped: Optional[List[dict]] = None,
                    syncs_per_layer: Optional[tuple] = None) -> dict:
    """`mapped`: the traces' routing for the shape already (shape_routing), reused across
    budgets: generating it is the slow part. `syncs_per_layer`: (native, prerouted) host
    syncs per MoE layer; None: today's decode path's."""
    from ..replay import simulate
    mapped = mapped if mapped is not None else shape_routing(shape, traces)
    tokens = sum(int(m["decode"].sum()) for m in mapped)
    if not tokens:
        raise ValueError("the routing trace has no decoded tokens: a decode forecast needs "
                         "them (record one with scripts/routing_stats.py record)")
    lfu = sum(simulate(m, budget, policy).decode_bytes_read for m in mapped) / tokens
    best = sum(simulate(m, budget, "belady").decode_bytes_read for m in mapped) / tokens
    c = Compute.from_profile(profile, shape)
    compute = (shape.layers * (c.resident_layer_s(1) + c.experts_s(shape.top_k, shape.top_k))
               + c.head_s)
    # the host sync model (profiles.json): a read-back per sync, and the GPU idle while the
    # host builds each synced layer's next work; the token's own sync (its sampled id)
    synced = lambda n: n * (c.host_sync_s + c.sync_idle_s)  # noqa: E731
    if syncs_per_layer is None:  # today's path: a streamed layer reads its routing back
        resident = budget >= shape.layers * shape.experts * shape.record_bytes
        syncs = synced(0 if resident else shape.layers) + c.host_sync_s
        pre_syncs = synced(1) + c.host_sync_s  # the first layer's, a token
    else:  # the path before: native read routing and evaluated the experts, prerouted
        native_n, pre_n = syncs_per_layer  # evaluated the experts
        syncs = shape.layers * (native_n * c.host_sync_s + c.sync_idle_s) + c.host_sync_s
        pre_syncs = shape.layers * (pre_n * c.host_sync_s + c.sync_idle_s) + c.host_sync_s
    rate = shape.record_bytes / profile.read_s(shape.record_bytes, readers)
    read = lfu / rate
    return {"bytes_per_token": lfu, "belady_bytes_per_token": best,
            "compute_ms": 1e3 * compute, "read_ms": 1e3 * read,
            "native_tok_s": 1 / (compute + syncs + read),
            "exact_limit_tok_s": 1 / max(compute, best / rate),
            "sync_ms": 1e3 * syncs,
            "prerouted_tok_s": 1 / max(compute + pre_syncs, read)}


def ttft_forecast(shape: Shape, profile: Profile, prompt: int, slots: int, chunk: int = 2048,
                  readers: int = 2) -> float:
    """Seconds to the first token from a cold start: each chunk reads each needed expert
    once (a layer needs min(E, chunk x k) of them; a pool smaller than that reads them all
    the same; a later chunk reads nothing if the pool kept them all) and computes the
    chunk, overlapped."""
    c = Compute.from_profile(profile, shape)
    rate = shape.record_bytes / profile.read_s(shape.record_bytes, readers)
    total = 0.0
    for start in range(0, prompt, chunk):
        t = min(chunk, prompt - start)
        needed = min(shape.experts, t * shape.top_k)
        kept = start > 0 and slots >= needed
        reads = 0.0 if kept else shape.layers * needed * shape.record_bytes / rate
        compute = shape.layers * (c.resident_layer_s(t) + c.experts_s(needed, t * shape.top_k))
        total += max(reads, compute)
    return total


def ttft_passes(shape: Shape, profile: Profile, prompt: int, slots: int, chunk: int = 2048,
                readers: int = 2, look_ahead: bool = True, ahead: int = 1) -> dict:
    """Seconds to the first token as the pass schedule runs it (edgemoe.streaming.calls),
    from a cold start, analytically: per chunk and layer, attention, the routing sync, the
    first pass's reads (overlapped by attention where a long chunk reads them ahead:
    edgemoe.streaming.prefill_ahead; none where the pool kept the previous chunk's last
    passes), then each pass's compute beside the next pass's reads, a sync a pass. `ahead`:
    passes read ahead (1, as built; 2, a whole pool of half-pool passes). The terms, summed
    over chunks and layers: {"total", "attention", "experts", "syncs", "first_pass_wait",
    "pass_reads_beyond_compute"}."""
    c = Compute.from_profile(profile, shape)
    r = profile.read_s(shape.record_bytes, readers)
    terms = dict.fromkeys(("attention", "experts", "syncs", "first_pass_wait",
                           "pass_reads_beyond_compute"), 0.0)
    for start in range(0, prompt, chunk):
        t = min(chunk, prompt - start)
        needed = min(shape.experts, t * shape.top_k)
        kept = start > 0 and slots >= needed  # every expert still in its slot: no reads
        size = needed if needed <= slots else max(1, slots // 2)
        n_passes = -(-needed // size)
        resident = 0 if start == 0 else min(slots, needed)  # the previous chunk's last
        attention = c.resident_layer_s(t)
        per_pass = c.experts_s(size, t * shape.top_k) / n_passes
        first = 0.0 if kept or resident >= size else size * r
        if look_ahead and start == 0 and slots < shape.experts \
                and t * shape.top_k >= 2 * shape.experts:
            resident = min(ahead * size, slots, needed)  # read while attention computes
            first = max(0.0, resident * r - attention)
        beyond = 0.0
        for i in range(1, n_passes):  # pass i's reads beside pass i - 1's compute
            read = 0.0 if kept or (i + 1) * size <= resident else \
                min(size, needed - i * size) * r
            beyond += max(0.0, read - per_pass)
        syncs = (1 + (n_passes if n_passes > 1 else 0)) * c.host_sync_s + c.sync_idle_s
        for name, value in (("attention", attention), ("experts", n_passes * per_pass),
                            ("syncs", syncs), ("first_pass_wait", first),
                            ("pass_reads_beyond_compute", beyond)):
            terms[name] += shape.layers * value
    terms["total"] = sum(terms.values())
    return terms


def report(model: str, machine: str, budgets: Optional[List[str]] = None,
           trace: Optional[str] = None, memory: Optional[int] = None):
    from ...streaming.trace import load_trace
    profile = load_profile(machine)
    defaults = machine_defaults(profile.name if profile.name in DEFAULTS else GENERIC)
    shape = shape_for(model)
    files = [Path(trace)] if trace else sorted(DEFAULT_TRACES.glob("*.npz"))
    if not files:  # the bundled model's traces are gone (a trimmed install)
        raise SystemExit(f"error: --machine forecasts from routing traces: expected --trace TRACE.npz "
                         f"(scripts/routing_stats.py record writes them), found none in {DEFAULT_TRACES}")
    traces = [load_trace(f) for f in files]
    plan = SlotPlan(tuple([shape.record_bytes] * shape.layers),
                    tuple([shape.experts] * shape.layers), shape.top_k)
    mem = memory or int(profile.value("memory_gb") * 1e9)
    print(f"machine: {profile.name} ({profile.chip}); {len(profile.unsourced())} of its figures "
          f"are unsourced estimates: {', '.join(profile.unsourced())}")
    print(f"model shape: {shape.name}: {shape.layers} MoE layers x {shape.experts} experts of "
          f"{fmt_bytes(shape.record_bytes)} (top-{shape.top_k}); routed experts "
          f"{fmt_bytes(shape.expert_bytes_total)}, resident {fmt_bytes(shape.resident_bytes)}")
    try:
        auto = auto_budget_bytes(plan.total_bytes, plan.minimum_bytes, int(shape.resident_bytes),
                                 int(AUTO_KV_TOKENS * shape.kv_bytes_per_token), mem)
        print(f"fits in {fmt_bytes(mem)}: --expert-budget auto gives {fmt_bytes(auto)} "
              f"({auto / plan.total_bytes:.0%} of the routed experts, "
              f"{plan.slots_for_bytes(auto)} slots per layer)")
    except BudgetError as e:
        auto = None
        print(f"does NOT fit in {fmt_bytes(mem)}: {e}")
    print(METHOD)
    how = ("relabelled onto" if all(native_geometry(shape, t) for t in traces) else
           "fitted per layer, routing generated for")
    print(f"  routing: {len(traces)} trace(s) from {files[0].parent} {how} the shape"
          + (" (the bundled model's held-out, teacher-forced traces: 128 experts, top-8)"
             if not trace else ""))
    rows = []
    mapped = shape_routing(shape, traces)
    asked = budgets or ["5%", "10%", "25%"]
    if auto:
        asked = asked + [auto]
    print(f"  {'budget':>10} {'slots':>5} {'MB/token':>9} {'native':>8} {'exact lim':>9} "
          f"{'prerouted':>9} {'TTFT 512':>9} {'TTFT 4096':>9}   (tok/s; cold TTFT, s, in "
          f"chunks of {defaults.prefill_step_size}: the machine's default)")
    for b in asked:
        budget_bytes = parse_budget(b, plan.total_bytes)
        slots = plan.slots_for_bytes(budget_bytes)
        label = b if isinstance(b, str) else "auto"
        if slots < shape.top_k:
            print(f"  {label:>10} below the minimum budget")
            continue
        f = decode_forecast(shape, profile, budget_bytes, traces, defaults.readers,
                            defaults.cache_policy, mapped)
        f.update(budget=label, slots=slots,
                 ttft_512_s=ttft_forecast(shape, profile, 512, slots,
                                          defaults.prefill_step_size, defaults.readers),
                 ttft_4096_s=ttft_forecast(shape, profile, 4096, slots,
                                           defaults.prefill_step_size, defaults.readers))
        rows.append(f)
        print(f"  {label:>10} {slots:>5} {f['bytes_per_token'] / 1e6:>9.1f} "
              f"{f['native_tok_s']:>8.1f} {f['exact_limit_tok_s']:>9.1f} "
              f"{f['prerouted_tok_s']:>9.1f} {f['ttft_512_s']:>9.2f} {f['ttft_4096_s']:>9.2f}")
    return rows
