"""The back-test: the twin, configured as each peer's design on its machine, against the
figure the peer published (docs/mac.md, "Back-test").

A peer's design is what decides its speed on a Mac, each term cited or marked assumed:

    syncs_per_layer   host reads of GPU results per streamed layer (0: the slot lookup on
                      the device, one read a token)
    cache             bytes of expert slots, and its policy (lru or lfu)
    top_k             experts run per token (Edge0 and flash-moe run 4 of 8 / 10)
    page_cache        warm: experts missing from the slots come from the OS page cache (as
                      much of the expert file as the memory left over holds), at
                      `copy_gbps` (0: zero-copy, the pages wrapped as GPU buffers); cold:
                      from the SSD, at the profile's rate with `readers` in flight
    hidden            the share of the SSD reads' time that overlaps compute (a read
                      started from a guess, during attention); with overlap "hits", at
                      most the compute of the experts that hit (streamlx computes them
                      while it reads the misses)
    compute_ms        the peer's own figure for the model with no host reads, where it
                      published one; else the shape's active bytes (its recurrent state's
                      traffic included) over the profile's int4
    sync_us, sync_idle_us
                      the host read and the GPU idle per sync in the peer's own runtime,
                      where it published them (flash-moe's C/Metal pipeline); else the
                      profile's, which are BigRig's Python MLX figures
    ssd_gbps          the peer's own measured SSD, where it published one for its machine

A decode token then takes (edgemoe.whatif.twin.forecast's terms, the host sync as a model of what
happens: the queue drains, the read's round trip, the GPU idle while the host builds):

    compute + layers x (syncs_per_layer x host_sync + sync_idle if syncs_per_layer)
            + page-cache copies + SSD reads x (1 - hidden)

The misses come from replaying routing for the peer's shape at its top-k
(edgemoe.whatif.twin.routing_gen: the bundled model's traces, fitted per layer; a 256- or
512-expert shape uses all of its experts) through its cache policy and size. Every figure
the forecast takes from a profile with a cited range (host sync, the GPU idle, an SSD, an
int4 rate) is also run at both ends: the sensitivity column.
"""

from dataclasses import asdict, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from ...streaming.cache import Recency
from ..replay import simulate
from .profiles import Profile, load_profile
from .routing_gen import shape_routing
from .shapes import Shape
from .peers import DESIGNS, Design, peer_shape

def _mem_hits(trace, cache_bytes: float, extra_bytes: float, shape: Shape, policy) -> tuple:
    """(slot misses per token, of which served from the page cache) from replays."""
    total = shape.expert_bytes_total
    frac = min(cache_bytes / total, 1.0)
    if frac >= 1.0:  # all resident, loaded before the first token
        return 0.0, 0.0
    r = simulate(trace, f"{100 * frac:.4f}%", policy) if frac * shape.experts >= trace[
        "routed"].shape[2] else None
    tokens = max(int(trace["decode"].sum()), 1)
    k = trace["routed"].shape[2]
    misses = (r.decode_on_demand if r else k * shape.layers * tokens) / tokens
    if extra_bytes <= 0 or frac >= 1.0:
        return misses, 0.0
    frac2 = min((cache_bytes + extra_bytes) / total, 1.0)
    r2 = simulate(trace, f"{100 * frac2:.4f}%", Recency)  # the page cache: LRU-like
    misses2 = r2.decode_on_demand / tokens
    return misses, max(misses - misses2, 0.0)


def routing(design: Design, traces: Sequence[dict], seed: int = 0) -> List[dict]:
    shape = peer_shape(design.shape)
    return shape_routing(shape, traces, seed=seed, top_k=design.top_k or shape.top_k)


def token_ms(design: Design, profile: Profile, misses: float, from_page_cache: float) -> dict:
    """Forecast milliseconds of one decode token, by term."""
    shape = peer_shape(design.shape)
    k = design.top_k or shape.top_k
    rate = profile.value("int4_gbps") * 1e9
    experts = 1e3 * shape.layers * k * shape.record_bytes / rate
    if design.compute_ms is not None:
        compute = design.compute_ms
    else:
        compute = 1e3 * (shape.layers * shape.resident_compute_bytes + shape.head_bytes) / rate \
            + experts
    sync_us = profile.value("host_sync_us") if design.sync_us is None else design.sync_us
    idle_us = (profile.value("sync_idle_us") if design.sync_idle_us is None
               else design.sync_idle_us)
    s = design.syncs_per_layer
    syncs = 1e-3 * (shape.layers * (s * sync_us + (idle_us if s else 0)) + sync_us)
    copy = (1e3 * from_page_cache * shape.record_bytes / (design.copy_gbps * 1e9)
            if design.copy_gbps else 0.0)
    ssd = profile if design.ssd_gbps is None else profile.with_value("ssd_read_gbps",
                                                                    design.ssd_gbps)
    ssd_records = misses - from_page_cache
    read = 1e3 * ssd_records * ssd.read_s(shape.record_bytes, design.readers)
    fetch = read + copy
    if design.overlap == "hits":  # the hits' experts computed while the misses are fetched
        hits_share = max(1 - misses / (k * shape.layers), 0.0)
        hidden = min(fetch * design.hidden, experts * hits_share)
    else:
        hidden = min(read * design.hidden, compute)
    # wrong guesses: random experts, missing from the pool as often as the pool is short;
    # they take the disk ahead of the true misses, so none of it is hidden
    cached = min(design.cache_bytes / shape.expert_bytes_total, 1.0)
    wasted = (shape.layers * design.lookahead_reads * (1 - design.lookahead_accuracy)
              * (1 - cached))
    guess = 1e3 * wasted * ssd.read_s(shape.record_bytes, design.readers)
    read += guess
    total = compute + syncs + copy + read - hidden
    return {"compute_ms": compute, "sync_ms": syncs, "copy_ms": copy, "read_ms": read,
            "wrong_guess_read_ms": guess,
            "hidden_ms": hidden, "token_ms": total, "tok_s": 1e3 / total}


SENSITIVE = ("host_sync_us", "sync_idle_us", "ssd_read_gbps", "ssd_latency_us", "int4_gbps")


def replay_misses(design: Design, traces: Sequence[dict], seed: int = 0,
                  routed: Optional[Dict[tuple, List[dict]]] = None) -> tuple:
    """(slot misses per decode token, of which from the page cache): the slow part, replays
    of the peer's routing through its cache."""
    shape = peer_shape(design.shape)
    policy = Recency if design.policy == "lru" else design.policy
    key = (design.shape, design.top_k or shape.top_k)
    routed = {} if routed is None else routed
    mapped = routed[key] if key in routed else routed.setdefault(key, routing(design, traces, seed))
    extra = design.memory_left_bytes if design.page_cache == "warm" else 0.0
    per = [_mem_hits(m, design.cache_bytes, extra, shape, policy) for m in mapped]
    return float(np.mean([p[0] for p in per])), float(np.mean([p[1] for p in per]))


def forecast(design: Design, traces: Sequence[dict] = (), seed: int = 0,
             routed: Optional[Dict[tuple, List[dict]]] = None,
             replayed: Optional[tuple] = None) -> dict:
    """One design's row: its misses replayed (or `replayed`, saved from an earlier run),
    then the timing model."""
    profile = load_profile(design.profile)
    shape = peer_shape(design.shape)
    misses, from_pc = replayed or replay_misses(design, traces, seed, routed)
    terms = token_ms(design, profile, misses, from_pc)
    k = design.top_k or shape.top_k
    sens = {}
    for fig in SENSITIVE:
        if "range" not in profile.figures.get(fig, {}):
            continue
        lo, hi = profile.span(fig)
        sens[fig] = [token_ms(design, profile.with_value(fig, v), misses, from_pc)["tok_s"]
                     for v in (lo, hi)]
    if design.copy_gbps and from_pc:  # a copy rate taken from the M4: down to zero-copy
        sens["copy_gbps"] = [terms["tok_s"], token_ms(replace(design, copy_gbps=0.0), profile,
                                                      misses, from_pc)["tok_s"]]
    own = None
    if design.published_miss_rate is not None:  # the timing model alone, on its misses
        m = design.published_miss_rate * k * shape.layers
        share = from_pc / misses if misses else 0.0
        own = token_ms(design, profile, m, m * share)["tok_s"]
    err = terms["tok_s"] / design.published - 1
    return {"peer": design.peer, "setting": design.setting, "published": design.published,
            "published_text": design.published_text, "source": design.source,
            "profile": design.profile, "shape": shape.name,
            "cache_share": min(design.cache_bytes / shape.expert_bytes_total, 1.0),
            "miss_rate": misses / (k * shape.layers), "misses_per_token": misses,
            "from_page_cache_per_token": from_pc, **terms, "error": err,
            "published_miss_rate": design.published_miss_rate,
            "tok_s_at_published_miss_rate": own,
            "error_at_published_miss_rate": None if own is None else own / design.published - 1,
            "sensitivity_tok_s": sens, "design": {k2: v for k2, v in asdict(design).items()
                                                   if k2 not in ("peer", "setting", "source")}}


def run(traces: Sequence[dict], designs: Sequence[Design] = DESIGNS, seed: int = 0,
        saved: Optional[dict] = None) -> dict:
    """Every design's row. With `saved` (an earlier run's JSON), each design's misses come
    from its row there (by peer and setting), and only the timing model runs again."""
    routed: Dict[tuple, List[dict]] = {}  # designs of one shape and top-k share routing
    before = {(r["peer"], r["setting"]): (r["misses_per_token"], r["from_page_cache_per_token"])
              for r in (saved or {}).get("rows", [])}
    rows = [forecast(d, traces, seed, routed, before.get((d.peer, d.setting)))
            for d in designs]
    within = [r for r in rows if abs(r["error"]) <= 0.25]
    return {"rows": rows, "figures": len(rows), "within_25pct": len(within),
            "method": __doc__.strip().splitlines()[0]}


def table(result: dict) -> str:
    lines = ["| peer | setting | published tok/s | FORECAST tok/s | error | cache, miss rate | "
             "ms: compute + syncs + copy + reads - hidden | at its own miss rate | "
             "sensitivity (tok/s, low-high) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        sens = "; ".join(f"{k.replace('_us', '').replace('_gbps', '')} "
                         f"{v[0]:.1f}-{v[1]:.1f}" for k, v in r["sensitivity_tok_s"].items())
        own = ("" if r["tok_s_at_published_miss_rate"] is None else
               f"{100 * r['published_miss_rate']:.1f}%: {r['tok_s_at_published_miss_rate']:.1f} "
               f"({100 * r['error_at_published_miss_rate']:+.0f}%)")
        lines.append(
            f"| {r['peer']} | {r['setting']} | {r['published_text']} | **{r['tok_s']:.1f}** | "
            f"**{100 * r['error']:+.0f}%** | {100 * r['cache_share']:.0f}%, "
            f"{100 * r['miss_rate']:.1f}% | {r['compute_ms']:.1f} + {r['sync_ms']:.1f} + "
            f"{r['copy_ms']:.1f} + {r['read_ms']:.1f} - {r['hidden_ms']:.1f} | {own} | "
            f"{sens} |")
    return "\n".join(lines)


# the peers' own settings at which edgemoe's forecast stands beside their figure (issue #50)
AT_PEERS = ["mlx-vlm PR #1813", "BigRig", "streamlx", "Edge0"]
BEFORE_HOTPATH = (2, 1)  # (native, prerouted) syncs a layer before edgemoe.mlx_backend.hostsync


def ours_at_peers(traces, peers: Sequence[str] = AT_PEERS) -> List[dict]:
    """edgemoe's analytic forecast (edgemoe.whatif.twin.forecast) at each peer's own model, machine
    and expert memory (its first design in DESIGNS: the cold or plain figure where it has
    one), and at 100% on the same machine: native and prerouted, on today's decode path and
    on the path before it (two syncs a streamed layer)."""
    from .forecast import decode_forecast
    rows = []
    for name in peers:
        d = next(d for d in DESIGNS if d.peer == name and d.page_cache == "cold"
                 or d.peer == name)
        shape, profile = peer_shape(d.shape), load_profile(d.profile)
        mapped = shape_routing(shape, traces)
        total = shape.layers * shape.experts * shape.record_bytes
        for label, budget in ((f"{d.cache_bytes / 1e9:.1f} GB", int(d.cache_bytes)),
                              ("100%", total)):
            row = {"peer": d.peer, "setting": d.setting, "published": d.published_text,
                   "shape": d.shape, "profile": d.profile, "budget": label}
            for path, syncs in (("before", BEFORE_HOTPATH), ("today", None)):
                f = decode_forecast(shape, profile, budget, traces, 2, "lfu", mapped,
                                    syncs_per_layer=syncs)
                row[f"native_{path}"] = f["native_tok_s"]
                row[f"prerouted_{path}"] = f["prerouted_tok_s"]
                row[f"sync_ms_{path}"] = f["sync_ms"]
                row["read_ms"], row["compute_ms"] = f["read_ms"], f["compute_ms"]
                row["mb_per_token"] = f["bytes_per_token"] / 1e6
            rows.append(row)
    return rows
