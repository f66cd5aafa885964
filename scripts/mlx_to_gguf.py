"""An mlx-lm 4-bit Qwen3-MoE checkpoint as a GGUF file llama.cpp runs, a tensor at a time.

    python scripts/mlx_to_gguf.py MLX_DIR OUT.gguf

For bench_large.py's llama.cpp row: the same model, as llama.cpp reads it, so that both
route alike and read alike. MLX's affine 4-bit codes in groups of 64 are exactly two Q4_1
blocks of 32 (x = d*q + m) with the group's scale and bias as d and m; rounding those to
float16 is all that changes. 8-bit tensors (the routers) and norms are written as F32.
Memory holds one tensor (an expert tensor's conversion goes a few experts at a time), so
it runs beside a model larger than memory. Needs `gguf` (pip install -e '.[peers]').
"""

import argparse
import json
import re
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgemoe.format.inplace import safetensors_header

ARCH = "qwen3moe"
Q4_1_BLOCK = 32
# mlx-lm module path -> llama.cpp tensor (blk.N. prefixed for a layer's)
NAMES = {
    "model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps", "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
}
_DTYPES = {"U32": np.uint32, "F32": np.float32, "F16": np.float16}
# GGUF writer setter -> config key
METADATA = {
    "add_context_length": "max_position_embeddings", "add_embedding_length": "hidden_size",
    "add_block_count": "num_hidden_layers", "add_feed_forward_length": "intermediate_size",
    "add_expert_feed_forward_length": "moe_intermediate_size",
    "add_head_count": "num_attention_heads", "add_head_count_kv": "num_key_value_heads",
    "add_key_length": "head_dim", "add_value_length": "head_dim",
    "add_rope_freq_base": "rope_theta", "add_layer_norm_rms_eps": "rms_norm_eps",
    "add_expert_count": "num_experts", "add_expert_used_count": "num_experts_per_tok",
}


class Shards:
    """The checkpoint's tensors, read one at a time from their safetensors shard."""

    def __init__(self, path: Path):
        self.where = {}  # name -> (file, offset, dtype, shape)
        for f in sorted(path.glob("model*.safetensors")):
            header, data_start = safetensors_header(f)
            for name, e in header.items():
                if e["dtype"] not in _DTYPES:
                    sys.exit(f"mlx_to_gguf: {f}: tensor {name}: dtype {e['dtype']}, expected "
                             f"one of {', '.join(_DTYPES)} (scales in bf16 are not handled)")
                self.where[name] = (f, data_start + e["data_offsets"][0], _DTYPES[e["dtype"]],
                                    tuple(e["shape"]))

    def read(self, name: str, rows=slice(None)) -> np.ndarray:
        f, offset, dtype, shape = self.where[name]
        return np.memmap(f, dtype=dtype, mode="r", offset=offset, shape=shape)[rows]


def q4_1(weight: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """MLX affine 4-bit (group 64) rows as Q4_1 rows: (..., cols / 32 * 20) bytes.

    MLX packs code k of a row at bits 4(k % 8) of word k // 8, so byte j holds codes 2j
    (low nibble) and 2j+1; a Q4_1 block holds d, m (float16), then byte j = code j | code
    j+16 << 4."""
    lead = weight.shape[:-1]
    packed = np.ascontiguousarray(weight).view(np.uint8)
    codes = np.stack([packed & 15, packed >> 4], axis=-1).reshape(*lead, -1, Q4_1_BLOCK)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    per_block = lambda a: np.repeat(a.astype(np.float16), 2, axis=-1)[..., None].view(np.uint8)  # noqa: E731
    return np.concatenate([per_block(scales), per_block(biases), qs], axis=-1).reshape(*lead, -1)


def dequantize(weight, scales, biases, group_size: int, bits: int) -> np.ndarray:
    """MLX affine codes of another width (the 8-bit routers) as float32, by MLX itself."""
    return np.array(mx.dequantize(mx.array(weight), mx.array(scales), mx.array(biases),
                                  group_size, bits).astype(mx.float32))


def gguf_name(module: str) -> str:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", module)
    if m:
        return f"blk.{m.group(1)}.{NAMES[m.group(2)]}.weight"
    return f"{NAMES[module]}.weight"


def tensors(shards: Shards, config: dict):
    """(gguf name, byte shape, numpy dtype, raw type or None, make) for every tensor, in
    file order; `make(rows)` builds the rows of the GGUF tensor's leading axis."""
    import gguf

    quant = config["quantization"]
    layer = lambda m: int(m.split(".")[2]) if m.startswith("model.layers.") else -1  # noqa: E731
    modules = sorted({n.rsplit(".", 1)[0] for n in shards.where}, key=lambda m: (layer(m), m))
    for module in modules:
        if module + ".weight" not in shards.where:
            continue
        weight = shards.where[module + ".weight"][3]
        if module + ".scales" not in shards.where:  # norms
            yield (gguf_name(module), weight, np.float32, None,
                   lambda rows, m=module: shards.read(m + ".weight", rows).astype(np.float32))
            continue
        q = quant.get(module, quant)
        bits = q["bits"]
        get = lambda part, rows, m=module: shards.read(f"{m}.{part}", rows)  # noqa: E731
        if bits == 4:
            shape = (*weight[:-1], weight[-1] * 8 // Q4_1_BLOCK * 20)
            yield (gguf_name(module), shape, np.uint8, gguf.GGMLQuantizationType.Q4_1,
                   lambda rows, g=get: q4_1(g("weight", rows), g("scales", rows),
                                            g("biases", rows)))
        else:
            shape = (*weight[:-1], weight[-1] * 32 // bits)
            yield (gguf_name(module), shape, np.float32, None,
                   lambda rows, g=get, q=q: dequantize(g("weight", rows), g("scales", rows),
                                                       g("biases", rows), q["group_size"],
                                                       q["bits"]))


def add_metadata(w, config: dict, tokenizer: dict):
    for setter, key in METADATA.items():
        getattr(w, setter)(config[key])
    w.add_file_type(3)  # mostly Q4_1
    # the tokenizer: byte-level BPE, as Qwen's
    model = tokenizer["model"]
    vocab = {**model["vocab"], **{t["content"]: t["id"] for t in tokenizer["added_tokens"]}}
    tokens = [None] * config["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    special = {t["id"] for t in tokenizer["added_tokens"] if t.get("special")}
    types = [3 if i in special else 1 for i in range(len(tokens))]
    for i, t in enumerate(tokens):  # rows of the embedding no token names
        if t is None:
            tokens[i], types[i] = f"[PAD{i}]", 5
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model["merges"]])
    w.add_eos_token_id(config["eos_token_id"])
    w.add_add_bos_token(False)


def convert(src: Path, dst: Path, rows_per_chunk: int = 8):
    try:
        import gguf
    except ImportError:
        sys.exit("mlx_to_gguf: needs the gguf package: pip install -e '.[peers]'")
    from tqdm import tqdm

    config = json.loads((src / "config.json").read_text())
    if config.get("model_type") != "qwen3_moe" or config.get("quantization", {}).get("bits") != 4:
        sys.exit(f"mlx_to_gguf: {src / 'config.json'}: expected a 4-bit mlx-lm qwen3_moe "
                 f"checkpoint, found model_type {config.get('model_type')!r}, "
                 f"bits {config.get('quantization', {}).get('bits')!r}")
    shards = Shards(src)
    plan = list(tensors(shards, config))
    partial = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(partial, ARCH)
    add_metadata(w, config, json.loads((src / "tokenizer.json").read_text()))
    for name, shape, dtype, raw, _ in plan:
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize,
                          raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d, _, _ in plan)
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing GGUF") as bar:
        for name, shape, dtype, _, make in plan:
            # expert tensors go a few experts at a time; others whole
            step = rows_per_chunk if len(shape) == 3 else shape[0]
            out = np.empty(shape, dtype)
            for lo in range(0, shape[0], step):
                out[lo:lo + step] = make(slice(lo, lo + step))
            w.write_tensor_data(out)
            bar.update(out.nbytes)
            del out
    w.close()
    partial.rename(dst)
    return total


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("src", type=Path, help="mlx-lm checkpoint (as make_large_checkpoint.py writes)")
    p.add_argument("dst", type=Path, help="the .gguf file to write")
    args = p.parse_args()
    if args.dst.exists():
        sys.exit(f"mlx_to_gguf: {args.dst}: exists; remove it first")
    size = convert(args.src, args.dst)
    print(f"wrote {args.dst}: {size / 1e9:.2f} GB of tensors")


if __name__ == "__main__":
    main()
