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

A decode token then takes (edgemoe.twin.forecast's terms, the host sync as a model of what
happens: the queue drains, the read's round trip, the GPU idle while the host builds):

    compute + layers x (syncs_per_layer x host_sync + sync_idle if syncs_per_layer)
            + page-cache copies + SSD reads x (1 - hidden)

The misses come from replaying routing for the peer's shape at its top-k
(edgemoe.twin.routing_gen: the bundled model's traces, fitted per layer; a 256- or
512-expert shape uses all of its experts) through its cache policy and size. Every figure
the forecast takes from a profile with a cited range (host sync, the GPU idle, an SSD, an
int4 rate) is also run at both ends: the sensitivity column.
"""

from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence

import numpy as np

from ..streaming.cache import Recency
from ..streaming.replay import simulate
from .profiles import Profile, load_profile
from .routing_gen import shape_routing
from .shapes import SHAPES, Shape

GiB = 2**30
# BigRig's M4: ~150 missed experts a token of 1.77 MB copied from the page cache in ~30% of
# a 58 ms token ("that copy runs at memory bandwidth, so threads do not help")
PC_COPY_GBPS = 150 * 1.77e6 / (0.30 * 0.058) / 1e9
STREAMLX = "https://github.com/srcterm/streamlx README.md"
BIGRIG = "https://github.com/arjvnv/BigRig docs/HOW-IT-WORKS.md"
SLOTSTREAM = "https://github.com/carloslfu/slotstream README.md"
SLOTSTREAM_WARM = ("https://github.com/carloslfu/slotstream "
                   "db/records/claims/warm-decode-12-tok-s-on-48-gb.md: 'The re-anchored "
                   "warm-decode ladder reads 11.2 tok/s at 120 experts per layer and 11.6 at "
                   "150, flat above that' (plain; its README's 20.0 is with the draft head)")
AS_QUOTED = "as issue #43 and shared/GUIDE.md quote it (primary text not found in the corpus searched)"
STREAMLX_AT = ("https://github.com/srcterm/streamlx at 7c08c0b (2026-08-09), the commit whose "
               "README first published the Qwen3.6 table")
# streamlx/reader.py at that commit: "F_NOCACHE is set as declared intent, but per F5 (macOS
# 26.3) reads populate the page cache anyway -- treated as a free reclaimable L2"
STREAMLX_F5 = "its streamlx/reader.py (F5: reads populate the page cache anyway)"
FLASH_MOE = ("https://github.com/danveloper/flash-moe CLAUDE.md (= README.md): 'Pipeline Per "
             "Layer (4.28ms average at 4-bit)'")
SLOTSTREAM_M = "https://github.com/carloslfu/slotstream MEASUREMENTS.md"
# slotstream's own Swift probe on its M5 Pro (MEASUREMENTS.md M0.4): a miss served from the
# page cache is a pread (48 records at QD16, cache-warm: 59.94 GB/s) then a batch scatter
# into the slot pool (49.77 GB/s)
SLOTSTREAM_COPY_GBPS = 1 / (1 / 59.94 + 1 / 49.77)
MACOS_BYTES = 4e9  # memory taken as macOS's own where a design's page cache is what is left

# shapes the twin's SHAPES lack, for peers' models
PEER_SHAPES = {
    # slotstream's Qwen3.8-Flash-Next: 48 layers x 512 experts, top-10, 2,764,800-byte
    # records (MEASUREMENTS.md M0.2). Computed per token: its measured trunk less what a
    # token only looks up (embed_tokens 0.358 GB; the 32 GB n-gram store, 16 rows a token):
    # Gated DeltaNet 1.189 + QSA attention 0.376 + hyper-connections 0.367 + norms and
    # lm_head 1.255 + shared experts 0.133 + routers 0.126 + ple 0.019 = 3.465 GB
    "slotstream-125b": Shape("slotstream-125b", 48, 2048, 802, 512, 10,
                             resident_params_per_layer=3.465e9 / 0.5625 / 48, head_params=0,
                             source=SLOTSTREAM_M + " M0.2 (48 layers, 512 experts, 10 "
                                    "active, 2.76 MB records; 3.465 GB of the 3.82 GB trunk "
                                    "computed per token)"),
    # flash-moe's Qwen3.5-397B-A17B: 60 layers, hidden 4096, moe_intermediate 1024, 512
    # experts, top-10, 1 shared expert; attention taken as ~60M params a layer (assumed)
    "qwen3.5-397b-a17b": Shape("qwen3.5-397b-a17b", 60, 4096, 1024, 512, 10,
                               resident_params_per_layer=60e6 + 3 * 4096 * 1024 + 4096 * 512,
                               head_params=248320 * 4096,
                               source="https://huggingface.co/Qwen/Qwen3.5-397B-A17B (60 "
                                      "layers, hidden 4096, moe_intermediate 1024, 512 "
                                      "experts, top-10; attention approximated)"),
}


def peer_shape(name: str) -> Shape:
    return SHAPES.get(name) or PEER_SHAPES[name]


@dataclass
class Design:
    peer: str
    setting: str
    published: float  # tok/s (the middle of a published range)
    published_text: str
    source: str
    profile: str
    shape: str
    cache_bytes: float  # expert slots
    policy: str = "lru"
    top_k: int = 0  # 0: the shape's
    syncs_per_layer: int = 1
    page_cache: str = "cold"  # cold | warm
    memory_left_bytes: float = 0.0  # warm: page cache for the expert file beyond the slots
    copy_gbps: float = 0.0  # warm: page cache to GPU copy rate (0: zero-copy)
    readers: int = 4
    hidden: float = 0.0
    compute_ms: Optional[float] = None
    compute_source: str = ""
    published_miss_rate: Optional[float] = None  # the peer's own, where it published one
    # a lookahead that reads up to `lookahead_reads` guessed experts a layer that are not
    # in the pool, right `lookahead_accuracy` of the time: its wrong guesses are reads too
    lookahead_reads: int = 0
    lookahead_accuracy: float = 1.0
    overlap: str = "guess"  # guess: reads overlap compute by `hidden`; hits: by at most the
    # compute of the experts that hit
    sync_us: Optional[float] = None  # the runtime's own host read per sync (None: profile's)
    sync_idle_us: Optional[float] = None  # and its GPU idle per synced layer
    ssd_gbps: Optional[float] = None  # the peer's own measured SSD (None: the profile's)
    notes: str = ""
    assumed: List[str] = field(default_factory=list)


DESIGNS: List[Design] = [
    # streamlx as it was when it published the Qwen3.6 table (7c08c0b): no lookahead yet
    # (added 2b98467, 2026-08-11), one routing read a layer, the hits computed (async_eval)
    # while the misses are read, LRU, 6 reader workers; measured by examples/sweep.py:
    # greedy decode of a one-line prompt, 96 tokens of warm-up, 192 measured. Its routing is
    # still generated from the held-out, teacher-forced traces: the bundled model's own
    # greedy continuations under that protocol repeat themselves and miss 0.8/0.4/0.2% at
    # 47/71/95% of the experts, against streamlx's 8.3/5.2/3.6% and the forced traces'
    # 20.4/5.5/0.7% (docs/mac.md, "Back-test"), so they are no closer to Qwen3.6's
    *[Design("streamlx", setting, tok_s, f"{tok_s}",
             f"{STREAMLX_AT} README.md (Performance); {STREAMLX_F5}",
             "m4-air-32gb", "qwen3.5-35b-a3b", gib * GiB, policy="lru", syncs_per_layer=1,
             page_cache="warm", memory_left_bytes=32e9 - resident - MACOS_BYTES,
             copy_gbps=PC_COPY_GBPS, readers=6, hidden=1.0, overlap="hits",
             published_miss_rate=miss, compute_ms=1000 / 33.3,
             compute_source=STREAMLX + ": --resident, all 40 MoE layers fit, 33.3 tok/s",
             notes="one routing read a layer; the hits computed while the misses are read; "
                   "reads fill the page cache (F5), so a miss the pool evicted earlier is a "
                   "copy from it",
             assumed=["macOS takes 4 GB; the page cache the rest of 32 GB less the "
                      "published resident", "page-cache copy at BigRig's M4 rate"])
      for setting, tok_s, gib, resident, miss in (
          ("Qwen3.6-35B-A3B 4-bit, 16 GiB budget, M4 Air 32 GB", 15.9, 16, 19e9, 0.036),
          ("same, 12 GiB budget", 7.6, 12, 15e9, 0.052),
          ("same, 8 GiB budget", 7.2, 8, 11e9, 0.083))],
    Design("BigRig", "Qwen3.6-35B-A3B 4-bit, 9.7 GB ceiling, M4 24 GB, warm, zero-copy", 21.0,
           "21 (47 ms)", BIGRIG, "m4-air-24gb", "qwen3.5-35b-a3b", 9.7e9 - 4.0e9 - 1.0e9,
           policy="lfu", syncs_per_layer=1, page_cache="warm",
           memory_left_bytes=24e9 - 9.7e9 - 4e9, copy_gbps=0.0,
           compute_ms=23.0, published_miss_rate=150 / 320, compute_source=BIGRIG + ": 'with no host reads at all the same "
           "token takes 23 ms'",
           notes="one host read per streamed layer; the pool is the page cache, misses "
                 "wrapped as GPU buffers (no copy); LFUDA (LFU here)",
           assumed=["pool = 9.7 GB less a 4 GB trunk and 1 GB of KV and buffers",
                    "page cache: 24 GB less the ceiling and 4 GB for macOS"]),
    Design("BigRig", "same, cold", 10.5, "10.5", BIGRIG + "; the cold figure " + AS_QUOTED,
           "m4-air-24gb", "qwen3.5-35b-a3b", 9.7e9 - 4.0e9 - 1.0e9, policy="lfu",
           syncs_per_layer=1, page_cache="cold", readers=2, compute_ms=23.0, published_miss_rate=150 / 320,
           compute_source=BIGRIG + ": 23 ms with no host reads",
           assumed=["readers 2 (pread on demand)"]),
    Design("mlx-vlm PR #1813", "Qwen3-30B-A3B 4-bit, 10.6 GB peak, M4 mini 16 GB", 14.1, "14.1",
           "mlx-vlm PR #1813 " + AS_QUOTED, "m4-mini-16gb", "qwen3-30b-a3b",
           10.6e9 - 1.7e9 - 1.0e9, policy="lru", syncs_per_layer=1, page_cache="warm",
           memory_left_bytes=16e9 - 10.6e9 - 3e9, copy_gbps=PC_COPY_GBPS, readers=2,
           notes="design not read (PR text not in the corpus): a Python MLX layer reading its "
                 "routing back, as every MLX streamer here does",
           assumed=["one sync a layer", "LRU", "pool = peak less the 1.7 GB trunk and 1 GB",
                    "page-cache copy 15.2 GB/s (BigRig's M4: ~150 x 1.77 MB in ~30% of 58 ms)"]),
    Design("Edge0", "35B tier (Qwen3.5/3.6-35B-A3B), 4 of 8 experts, M4 Pro 24 GB", 16.3,
           "14.9-17.7", "Edge0 " + AS_QUOTED, "m4-pro-24gb", "qwen3.5-35b-a3b",
           11.7 * GiB - 4.0e9 - 1.0e9, policy="lfu", top_k=4, syncs_per_layer=1,
           readers=2, hidden=0.5,
           notes="expert-to-slot table on the device, one sync a step on predicted layers; "
                 "which layers are predicted is not published: one sync a layer taken",
           assumed=["pool = 11.7 GiB RSS less 4 GB trunk and 1 GB", "one sync a layer",
                    "hidden 0.5 (its heads' 55-65% agreement)"]),
    Design("slotstream", "125B (104 GB), 150 experts/layer, warm, plain decode, M5 Pro 48 GB",
           11.6, "11.6 ('~12')", SLOTSTREAM_WARM, "m5-pro-48gb", "slotstream-125b",
           150 * 48 * 2.77e6, policy="lru", syncs_per_layer=1, page_cache="warm",
           memory_left_bytes=48e9 - 150 * 48 * 2.77e6 - 3.9e9 - 6e9,
           copy_gbps=SLOTSTREAM_COPY_GBPS, readers=8,
           notes="one pool for all layers (an even split here), Swift; the sync at the end of "
                 "ensure removed (+10%), a barrier every 4 layers: one read a layer kept; "
                 "pread into slots, so a page-cache hit is a copy",
           assumed=["mlx-swift's sync taken as BigRig's Python MLX figures (none "
                    "published for Swift)", "page-cache copy: its own pread (59.94 GB/s) "
                    "then batch scatter (49.77 GB/s), 27.2 GB/s (MEASUREMENTS.md M0.4)"]),
    Design("slotstream", "same, 120 experts/layer", 11.2, "11.2", SLOTSTREAM_WARM,
           "m5-pro-48gb", "slotstream-125b", 120 * 48 * 2.77e6, policy="lru",
           syncs_per_layer=1, page_cache="warm",
           memory_left_bytes=48e9 - 120 * 48 * 2.77e6 - 3.9e9 - 6e9,
           copy_gbps=SLOTSTREAM_COPY_GBPS, readers=8),
    Design("flash-moe", "Qwen3.5-397B-A17B, 4 of 10 experts, M3 Max 48 GB", 4.36, "4.36",
           FLASH_MOE, "m3-max-48gb", "qwen3.5-397b-a17b", 0.0, policy="lru",
           top_k=4, syncs_per_layer=2, page_cache="warm",
           memory_left_bytes=35e9, copy_gbps=PC_COPY_GBPS, readers=8,
           sync_us=10.0, sync_idle_us=43.0, ssd_gbps=17.5,
           compute_ms=60 * (1.22 + 0.55),
           compute_source=FLASH_MOE + ": CMD1 attention projections + delta-net 1.22 ms "
           "and CMD2 o_proj + norm + routing + shared 0.55 ms of GPU a layer (CMD3, the "
           "experts, runs behind the next layer's CMD1), x 60 layers",
           notes="C and Metal, no expert cache of its own: the OS page cache (~35 GB) is the "
                 "cache, parallel pread per expert (a copy out of the page cache); a layer "
                 "waits twice on the GPU (CMD1's results flushed, 0.01 ms; CMD2's routing, "
                 "0.003 ms of softmax and top-k) and encodes CMD3 in 0.04 ms: its sync is "
                 "10 us and 43 us of GPU idle, not BigRig's Python figures; serial "
                 "GPU -> SSD -> GPU (nothing hidden); its SSD measured 17.5 GB/s; its page "
                 "cache 'achieves ~71% hit rate'",
           assumed=["page-cache copy at BigRig's M4 rate (sensitivity: zero-copy)",
                    "8 reads in flight (GCD dispatch group of K=4 experts' ranges)"]),
    Design("streamlx (resident)", "Qwen3.6-35B-A3B, all resident, M4 Air 32 GB", 33.3, "33.3",
           STREAMLX + " (--resident)", "m4-air-32gb", "qwen3.5-35b-a3b", 40 * 256 * 1.77e6,
           syncs_per_layer=0,
           notes="mlx-lm's own decode (no per-layer reads): compute from the M4's kernels "
                 "(BigRig's Qwen3-30B 21.0 ms) over the shape's active bytes"),
]


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
BEFORE_HOTPATH = (2, 1)  # (native, prerouted) syncs a layer before edgemoe.model.hostsync


def ours_at_peers(traces, peers: Sequence[str] = AT_PEERS) -> List[dict]:
    """edgemoe's analytic forecast (edgemoe.twin.forecast) at each peer's own model, machine
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
