"""Named model shapes for the twin, their expert records on disk, and routing mapped onto them.

A shape is what the twin needs of a model: its MoE layers, experts, top-k, the expert
record's tensors as edgemoe.convert lays them out (so a record has the real size), and
the resident weights a decode step computes (attention, router, shared expert, lm_head),
for the compute waits. Figures come from each model's published config (`source`).

A *shape pack* holds the records of a few physical layers (`write_shape_pack`, records
of random bytes with their CRC32, written by edgemoe.format.pack's ExpertsWriter as
convert writes them); `open_shape_pack` presents it as a Pack of all the shape's layers,
logical layer l reading physical layer l mod P's records. So every read has the real
size and lands in a real file, without writing 100s of GB. (`make_large_checkpoint.py`
writes whole qwen3_moe checkpoints to convert; the validation uses it for the A3B-shaped
model that really runs. The twin needs only the records.)

Routing is mapped from a recorded trace (`map_trace`): layer l of the shape takes trace
layer l mod L_trace; an expert id e of a trace layer becomes, through a fixed random
permutation per layer, r = E_shape / E_trace candidates perm[e]*r .. perm[e]*r + r-1, of
which q = k_shape / k_trace are taken (a fixed random choice per (layer, expert)); with
q < 1 the first k_shape ids of each token are kept. So reuse across tokens, the skew of
usage and the overlap of successive tokens carry over from the trace, and a 1:1 map
(128/top-8 trace onto a 128/top-8 shape) is a pure relabelling.
"""

import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...format.pack import ALIGNMENT, EXPERTS_FILE, Pack, PackLayer
from ...format.records import Record, TensorLayout, aligned
from ...format.writer import ExpertsWriter

INT4_BYTES_PER_PARAM = 0.5 + 4 / 64  # affine 4-bit, groups of 64, bf16 scales and biases
SHAPE_PACK_CAP = 4 * 10**9  # physical layers written: as many as fit this (at least one)
PREROUTER_HEAD_HIDDEN = 256  # edgemoe.mlx_backend.prerouter's default width, as shipped


@dataclass(frozen=True)
class Shape:
    name: str
    layers: int  # MoE layers
    hidden: int
    moe_intermediate: int
    experts: int
    top_k: int
    # resident parameters a decode step computes, per MoE layer (attention, router, shared
    # expert; a dense layer's FFN is spread over the MoE layers) and once (lm_head)
    resident_params_per_layer: float
    head_params: float
    quant: str = "affine4"  # affine4 (mlx-lm -q, g64, bf16 scales) or mxfp4 (gpt-oss)
    source: str = ""
    fused_gate_up: bool = False
    kv_bytes_per_token: float = 0.0  # KV cache at bf16, every layer that keeps one
    embed_params: float = 0.0  # the embedding table (resident, not computed per token)
    # recurrent state a decode step reads and writes, per MoE layer on average (Gated
    # DeltaNet's fp32 state): memory traffic like the weights', counted at the same rate
    state_bytes_per_layer: float = 0.0

    def record_tensors(self) -> List[Tuple[str, str, tuple]]:
        """(name, dtype, shape) of one expert's tensors, sorted by name as convert lays
        them out (edgemoe.format.writer.record_layout)."""
        d, f = self.hidden, self.moe_intermediate
        projs = {"down_proj": (d, f)}
        if self.fused_gate_up:
            projs["gate_up_proj"] = (2 * f, d)
        else:
            projs.update(gate_proj=(f, d), up_proj=(f, d))
        out = []
        for name, (o, i) in projs.items():
            if self.quant == "affine4":
                out += [(f"{name}.weight", "uint32", (o, i // 8)),
                        (f"{name}.scales", "bfloat16", (o, i // 64)),
                        (f"{name}.biases", "bfloat16", (o, i // 64))]
            elif self.quant == "mxfp4":
                out += [(f"{name}.weight", "uint32", (o, i // 8)),
                        (f"{name}.scales", "uint8", (o, i // 32)),
                        (f"{name}.bias", "bfloat16", (o,))]
            else:
                raise ValueError(f"shape {self.name}: quantization {self.quant!r}: choose "
                                 f"affine4 or mxfp4")
        return sorted(out)

    def layout(self) -> List[TensorLayout]:
        layout, offset = [], 0
        for name, dtype, shape in self.record_tensors():
            nbytes = int(np.prod(shape)) * np.dtype(
                {"bfloat16": np.uint16}.get(dtype, dtype)).itemsize
            layout.append(TensorLayout(name, dtype, tuple(shape), offset, nbytes))
            offset += nbytes
        return layout

    @property
    def record_bytes(self) -> int:
        return sum(t.nbytes for t in self.layout())

    @property
    def expert_params(self) -> float:
        return 3 * self.hidden * self.moe_intermediate

    @property
    def resident_layer_bytes(self) -> float:
        return self.resident_params_per_layer * INT4_BYTES_PER_PARAM

    @property
    def resident_compute_bytes(self) -> float:
        """What a decode step reads per layer besides its experts: weights and state."""
        return self.resident_layer_bytes + self.state_bytes_per_layer

    @property
    def head_bytes(self) -> float:
        return self.head_params * INT4_BYTES_PER_PARAM

    @property
    def prerouter_head_params(self) -> float:
        """One prerouter head (edgemoe.mlx_backend.prerouter.PrerouterHead, 256 wide, as
        trained): [hidden, the routing now and a token before] -> 256 -> experts."""
        return (self.hidden + 2 * self.experts) * PREROUTER_HEAD_HIDDEN \
            + PREROUTER_HEAD_HIDDEN * self.experts

    @property
    def active_bytes_per_token(self) -> float:
        """Weights one decode step computes: resident + top-k records per layer."""
        return (self.layers * (self.resident_compute_bytes + self.top_k * self.record_bytes)
                + self.head_bytes)

    @property
    def active_params_per_token(self) -> float:
        return (self.layers * (self.resident_params_per_layer + self.top_k * self.expert_params)
                + self.head_params)

    @property
    def resident_bytes(self) -> float:
        """What stays in memory besides the experts: every layer's resident weights, the
        lm_head and the embedding table, at int4."""
        return (self.layers * self.resident_params_per_layer + self.head_params
                + self.embed_params) * INT4_BYTES_PER_PARAM

    @property
    def expert_bytes_total(self) -> int:
        return self.layers * self.experts * self.record_bytes

    def to_json(self) -> dict:
        return {"name": self.name, "layers": self.layers, "experts": self.experts,
                "top_k": self.top_k, "record_bytes": self.record_bytes,
                "expert_bytes_total": self.expert_bytes_total,
                "active_bytes_per_token": self.active_bytes_per_token,
                "source": self.source}


def _attn(d, heads, kv, head_dim):
    return d * heads * head_dim * 2 + d * kv * head_dim * 2


def _gated_attn(d, heads, kv, head_dim):
    """Qwen3.5's full attention: q_proj also yields the output gate (attn_output_gate)."""
    return d * heads * head_dim * 2 + d * kv * head_dim * 2 + heads * head_dim * d


def _gated_deltanet(d, key_heads, value_heads, key_dim, value_dim, conv):
    """Qwen3.5's Gated DeltaNet: in_proj_qkvz, in_proj_ba, the short conv over q, k, v,
    out_proj (mlx-lm's qwen3_next/qwen3_5 layout)."""
    k, v = key_heads * key_dim, value_heads * value_dim
    return d * (2 * k + 2 * v) + d * 2 * value_heads + (2 * k + v) * conv + v * d


def _deltanet_state_traffic(key_heads, value_heads, key_dim, value_dim, conv):
    """Bytes a decode step reads and writes of one Gated DeltaNet layer's state: the fp32
    recurrent state (value heads x key_dim x value_dim) and the bf16 conv state."""
    recurrent = value_heads * key_dim * value_dim * 4
    conv_state = (2 * key_heads * key_dim + value_heads * value_dim) * (conv - 1) * 2
    return 2 * (recurrent + conv_state)


SHAPES: Dict[str, Shape] = {s.name: s for s in [
    Shape("qwen3-30b-a3b", 48, 2048, 768, 128, 8,
          resident_params_per_layer=_attn(2048, 32, 4, 128) + 2048 * 128,
          head_params=151936 * 2048, embed_params=151936 * 2048,
          kv_bytes_per_token=48 * 2 * 4 * 128 * 2,
          source="https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (48 layers, "
                 "hidden 2048, moe_intermediate 768, 128 experts, top-8, 32/4 heads of 128)"),
    Shape("qwen3.5-35b-a3b", 40, 2048, 512, 256, 8,
          # from its config: every 4th layer full attention (full_attention_interval 4),
          # the other 30 Gated DeltaNet, plus each layer's router and shared expert (512)
          resident_params_per_layer=(10 * _gated_attn(2048, 16, 2, 256)
                                     + 30 * _gated_deltanet(2048, 16, 32, 128, 128, 4)) / 40
          + 2048 * 256 + 3 * 2048 * 512,
          head_params=248320 * 2048, embed_params=248320 * 2048,
          kv_bytes_per_token=10 * 2 * 2 * 256 * 2,  # the 10 full-attention layers
          state_bytes_per_layer=30 * _deltanet_state_traffic(16, 32, 128, 128, 4) / 40,
          source="https://huggingface.co/Qwen/Qwen3.5-35B-A3B config.json (40 layers, "
                 "hidden 2048, layer_types 3 linear_attention : 1 full_attention, full: 16 "
                 "heads of 256 with an output gate, 2 kv heads; linear: 16 key heads and 32 "
                 "value heads of 128, conv kernel 4, fp32 state (mamba_ssm_dtype); "
                 "moe_intermediate 512, 256 experts, top-8 + 1 shared of 512; Qwen3.6-35B-"
                 "A3B has the same shape)"),
    Shape("qwen3-235b-a22b", 94, 4096, 1536, 128, 8,
          resident_params_per_layer=_attn(4096, 64, 4, 128) + 4096 * 128,
          head_params=151936 * 4096, embed_params=151936 * 4096,
          kv_bytes_per_token=94 * 2 * 4 * 128 * 2,
          source="https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json (94 "
                 "layers, hidden 4096, moe_intermediate 1536, 128 experts, top-8, 64/4 heads "
                 "of 128)"),
    Shape("gpt-oss-120b", 36, 2880, 2880, 128, 4,
          resident_params_per_layer=_attn(2880, 64, 8, 64) + 2880 * 128,
          head_params=201088 * 2880, quant="mxfp4", fused_gate_up=True,
          embed_params=201088 * 2880, kv_bytes_per_token=36 * 2 * 8 * 64 * 2,
          source="https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json (36 layers, "
                 "hidden 2880, intermediate 2880, 128 experts, top-4, MXFP4 experts)"),
    Shape("deepseek-v3", 58, 7168, 2048, 256, 8,
          # MLA attention ~187M params a layer; 3 dense layers' FFN (3 x 396M) spread over
          # the 58 MoE layers; the shared expert (2048)
          resident_params_per_layer=187e6 + 3 * 396e6 / 58 + 3 * 7168 * 2048 + 7168 * 256,
          head_params=129280 * 7168, embed_params=129280 * 7168,
          kv_bytes_per_token=61 * (512 + 64) * 2,  # MLA's compressed cache
          source="https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (61 "
                 "layers, first 3 dense, hidden 7168, moe_intermediate 2048, 256 routed "
                 "experts, top-8, 1 shared)"),
]}


def shape_from_config(config: dict, name: str = "model") -> Shape:
    """A Shape from a Hugging Face / mlx-lm config.json of a Qwen3-MoE-like model (hidden,
    moe_intermediate, experts, top-k, attention heads): affine int4 records as convert
    writes them."""
    c = config.get("text_config", config)
    d = c["hidden_size"]
    f = c.get("moe_intermediate_size") or c["intermediate_size"]
    e = c.get("num_experts") or c.get("num_local_experts") or c["n_routed_experts"]
    k = c["num_experts_per_tok"]
    heads, kv = c.get("num_attention_heads", 16), c.get("num_key_value_heads", 4)
    hd = c.get("head_dim") or d // heads
    dense = c.get("first_k_dense_replace", 0)
    layers = c["num_hidden_layers"] - dense
    vocab = c.get("vocab_size", 32000)
    shared = (c.get("shared_expert_intermediate_size") or
              (c.get("n_shared_experts") or 0) * f)
    return Shape(name, layers, d, f, e, k,
                 resident_params_per_layer=_attn(d, heads, kv, hd) + d * e + 3 * d * shared,
                 head_params=vocab * d, embed_params=vocab * d,
                 kv_bytes_per_token=c["num_hidden_layers"] * 2 * kv * hd * 2,
                 source="config.json (attention taken as plain GQA)")


def tiny_shape(layers=3, experts=16, top_k=2, hidden=128, inter=64) -> Shape:
    """A shape for tests (records of a few KB)."""
    return Shape(f"tiny-{layers}x{experts}", layers, hidden, inter, experts, top_k,
                 resident_params_per_layer=4 * hidden * hidden, head_params=1000 * hidden)


def get_shape(name: str) -> Shape:
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}: choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def physical_layers_for(shape: Shape, cap_bytes: int = SHAPE_PACK_CAP) -> int:
    return max(1, min(shape.layers, cap_bytes // (shape.experts * aligned(shape.record_bytes))))


def write_shape_pack(shape: Shape, out: Path, physical_layers: Optional[int] = None,
                     seed: int = 0) -> Path:
    """experts.bin of `physical_layers` layers of random records and twin.json (the shape,
    the records' offsets and CRC32s). Never commit it; delete it when done."""
    out = Path(out)
    p = physical_layers or physical_layers_for(shape)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    block = np.frombuffer(rng.bytes(64 * 2**20 + shape.record_bytes), dtype=np.uint8)
    writer = ExpertsWriter(out / EXPERTS_FILE)
    records = []
    for layer in range(p):
        for e in range(shape.experts):
            start = int(rng.integers(0, 64 * 2**20))  # a different slice of the block
            r = writer.write([block[start:start + shape.record_bytes]])
            records.append([r.offset, r.length, r.crc32])
    size = writer.close()
    meta = {"shape": shape.name, "physical_layers": p, "experts": shape.experts,
            "record_bytes": shape.record_bytes, "experts_file_size": size,
            "records": records, "shape_json": shape.to_json()}
    (out / "twin.json").write_text(json.dumps(meta))
    return out


def open_shape_pack(folder: Path, shape: Shape) -> Pack:
    """The shape pack as a Pack of all `shape.layers` MoE layers (logical layer l reads
    physical layer l mod P's records)."""
    folder = Path(folder)
    meta = json.loads((folder / "twin.json").read_text())
    if meta["record_bytes"] != shape.record_bytes or meta["experts"] != shape.experts:
        raise ValueError(f"{folder}: a shape pack of {meta['shape']} ({meta['experts']} "
                         f"experts of {meta['record_bytes']} bytes), not of {shape.name}")
    size = (folder / EXPERTS_FILE).stat().st_size
    if size != meta["experts_file_size"]:
        raise ValueError(f"{folder / EXPERTS_FILE}: truncated (expected "
                         f"{meta['experts_file_size']} bytes, found {size})")
    p, recs = meta["physical_layers"], meta["records"]
    layout = shape.layout()
    layers = []
    for l in range(shape.layers):
        base = (l % p) * shape.experts
        records = [Record(((0, o, n),), c) for o, n, c in recs[base:base + shape.experts]]
        layers.append(PackLayer(f"model.layers.{l}.mlp.switch_mlp", l, layout, {}, records))
    return Pack(folder, "twin:" + shape.name, shape.top_k, layers, size)


# -- routing mapped onto a shape --

def map_trace(trace: Dict[str, np.ndarray], shape: Shape, seed: int = 0) -> Dict[str, np.ndarray]:
    """`trace` (edgemoe.streaming.trace) as if recorded on `shape` (the module doc's map):
    routed ids, layers, record sizes and any recorded prefetches."""
    routed = trace["routed"]
    n_tok, L_t, k_t = routed.shape
    E_t = int(trace["num_experts"].max()) if "num_experts" in trace else int(routed.max()) + 1
    E_s, k_s = shape.experts, shape.top_k
    if E_s < E_t:
        raise ValueError(f"trace of {E_t} experts per layer onto {shape.name} ({E_s}): a shape "
                         f"needs at least the trace's experts")
    r = E_s // E_t
    q = k_s / k_t
    if q > r:
        raise ValueError(f"trace top-{k_t} of {E_t} cannot give top-{k_s} of {E_s} distinct "
                         f"experts per token ({k_s // k_t} per trace expert, {r} available)")
    rng = np.random.default_rng(seed)
    # per shape layer: expert e of its trace layer -> its ids in the shape
    table = []
    per = max(1, int(q))
    for l in range(shape.layers):
        perm = rng.permutation(E_t)
        subs = np.stack([rng.choice(r, per, replace=False) for _ in range(E_t)])
        table.append(perm[:, None] * r + subs)  # (E_t, per)
    out_routed = np.empty((n_tok, shape.layers, k_s if q >= 1 else k_s), dtype=np.int32)
    for l in range(shape.layers):
        ids = table[l][routed[:, l % L_t]]  # (n, k_t, per)
        ids = ids.reshape(n_tok, -1)
        out_routed[:, l] = ids[:, :k_s]
    mapped = dict(trace)
    mapped.update(routed=out_routed, layers=np.arange(shape.layers, dtype=np.int32),
                  expert_bytes=np.full(shape.layers, shape.record_bytes, dtype=np.int64),
                  num_experts=np.full(shape.layers, E_s, dtype=np.int32))
    mapped.pop("model", None)
    if "prefetch_at" in trace and len(trace["prefetch_at"]):
        mapped.update(_map_prefetches(trace, shape, table, L_t, k_s))
    return mapped


def _map_prefetches(trace, shape, table, L_t, k_s):
    """Prefetches of trace layer t apply to every shape layer l with l mod L_t == t."""
    at, counts, experts = trace["prefetch_at"], trace["prefetch_counts"], trace["prefetch_experts"]
    chunks = np.split(experts, np.cumsum(counts)[:-1])
    new_at, new_counts, new_experts = [], [], []
    by_call: Dict[int, list] = {}
    for (call, src, tgt, lead), ids in zip(at.tolist(), chunks):
        by_call.setdefault(call, []).append((src, tgt, lead, ids))
    for call in sorted(by_call):
        items = by_call[call]
        for rep in range(-(-shape.layers // L_t)):
            for src, tgt, lead, ids in items:
                l_src = -1 if src < 0 else src + rep * L_t
                l_tgt = tgt + rep * L_t
                if l_tgt >= shape.layers or l_src >= shape.layers:
                    continue
                mapped = np.unique(table[l_tgt][ids].reshape(-1))
                new_at.append([call, l_src, l_tgt, lead])
                new_counts.append(len(mapped))
                new_experts.append(mapped)
    # the replay issues (call, position) in recorded order within a call: sort by source
    order = sorted(range(len(new_at)), key=lambda i: (new_at[i][0], new_at[i][1]))
    return {"prefetch_at": np.array([new_at[i] for i in order], dtype=np.int32).reshape(-1, 4),
            "prefetch_counts": np.array([new_counts[i] for i in order], dtype=np.int32),
            "prefetch_experts": np.concatenate([new_experts[i] for i in order]).astype(np.int32)
            if new_at else np.zeros(0, dtype=np.int32)}
