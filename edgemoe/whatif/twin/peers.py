"""The peers' designs as they published them, each term cited or marked assumed: what the
back-test (edgemoe.whatif.twin.backtest) configures the twin as, and the figure it forecasts."""

from dataclasses import dataclass, field
from typing import List, Optional

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
