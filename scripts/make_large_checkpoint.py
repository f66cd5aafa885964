"""Write a synthetic Qwen3-MoE checkpoint of a chosen size, a layer at a time.

    python scripts/make_large_checkpoint.py OUT --size 30GB [--format mlx|hf]
           [--hidden 2048] [--moe-intermediate 768] [--experts 128] [--top-k 8]

`--format mlx` (the default) is an mlx-lm int4 checkpoint as `mlx_lm.convert -q` writes
it (4-bit affine groups of 64, routers at 8 bits, scales in --dtype); `--format hf` is a
Hugging Face checkpoint in --dtype with one tensor per expert, as Qwen3-MoE ships. The layer shapes
default to Qwen3-30B-A3B's; the number of layers is what reaches `--size`. Weights are
random (quantized codes and floats uniform, scaled to keep activations near 1),
the routers decisive (large logits, so each token has a clear top-k). Each layer goes to
its own shard as it is made, so memory holds one layer whatever the size. The tokenizer is
the bundled model's. Never commit the output; delete it when done.
"""

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

import mlx.core as mx
from tqdm import tqdm

from edgemoe.format.source import BUNDLED_MODEL
from edgemoe.streaming.budget import parse_budget

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
BITS, GROUP, ROUTER_BITS = 4, 64, 8


def config_for(args, layers: int, vocab: int) -> dict:
    c = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
         "hidden_size": args.hidden, "intermediate_size": args.moe_intermediate * 8,
         "moe_intermediate_size": args.moe_intermediate, "num_experts": args.experts,
         "num_experts_per_tok": args.top_k, "num_hidden_layers": layers,
         "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
         "head_dim": args.head_dim, "vocab_size": vocab, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-6, "rope_theta": 1e6, "norm_topk_prob": True,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "tie_word_embeddings": False,
         "attention_bias": False, "hidden_act": "silu", "torch_dtype": args.dtype,
         "eos_token_id": 2, "bos_token_id": None}
    if args.format == "mlx":
        q = {"group_size": GROUP, "bits": BITS, "mode": "affine"}
        q.update({f"model.layers.{i}.mlp.gate": {"group_size": GROUP, "bits": ROUTER_BITS}
                  for i in range(layers)})
        c["quantization"] = c["quantization_config"] = q
    return c


def random_words(shape) -> mx.array:
    """Uniform random uint32 words (quantized codes), from two 16-bit halves."""
    half = lambda: mx.random.randint(0, 2 ** 16, shape, dtype=mx.uint32)  # noqa: E731
    return (half() << 16) | half()


def linear(name: str, out_dim: int, in_dim: int, fmt: str, dtype, bits: int = BITS,
           gain: float = 1.0, lead=()) -> dict:
    """One linear layer's tensors (stacked over `lead` experts if given), with weights
    of about gain / sqrt(in_dim)."""
    std = gain / math.sqrt(in_dim)
    if fmt == "hf":
        bound = math.sqrt(3) * std  # uniform: cheaper to draw than normal, same std
        return {f"{name}.weight": mx.random.uniform(-bound, bound, (*lead, out_dim, in_dim),
                                                    dtype=dtype)}
    levels = 2 ** bits
    scale = 2 * math.sqrt(3) * std / levels  # codes uniform: the weights' std is `std`
    groups = (*lead, out_dim, in_dim // GROUP)
    return {f"{name}.weight": random_words((*lead, out_dim, in_dim * bits // 32)),
            f"{name}.scales": mx.full(groups, scale, dtype),
            f"{name}.biases": mx.full(groups, -scale * (levels - 1) / 2, dtype)}  # mean 0


def layer_tensors(i: int, args) -> dict:
    f, h, m, e = args.format, args.hidden, args.moe_intermediate, args.experts
    dt = getattr(mx, args.dtype)
    p = f"model.layers.{i}"
    t = {f"{p}.input_layernorm.weight": mx.ones((h,), dt),
         f"{p}.post_attention_layernorm.weight": mx.ones((h,), dt),
         f"{p}.self_attn.q_norm.weight": mx.ones((args.head_dim,), dt),
         f"{p}.self_attn.k_norm.weight": mx.ones((args.head_dim,), dt)}
    q, kv = args.heads * args.head_dim, args.kv_heads * args.head_dim
    for name, (o, n) in {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h),
                         "o_proj": (h, q)}.items():
        t.update(linear(f"{p}.self_attn.{name}", o, n, f, dt))
    t.update(linear(f"{p}.mlp.gate", e, h, f, dt, ROUTER_BITS, gain=args.router_gain))
    shapes = {"gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}
    for name, (o, n) in shapes.items():
        if f == "mlx":
            t.update(linear(f"{p}.mlp.switch_mlp.{name}", o, n, f, dt, lead=(e,)))
        else:
            for x in range(e):
                t.update(linear(f"{p}.mlp.experts.{x}.{name}", o, n, f, dt))
    return t


def nbytes(tensors: dict) -> int:
    return sum(a.nbytes for a in tensors.values())


def write(out: Path, args):
    vocab = json.loads((BUNDLED_MODEL / "config.json").read_text())["vocab_size"]
    mx.random.seed(args.seed)
    dt = getattr(mx, args.dtype)
    outer = {"model.embed_tokens": linear("model.embed_tokens", vocab, args.hidden,
                                          args.format, dt),
             "lm_head": linear("lm_head", vocab, args.hidden, args.format, dt)}
    outer = {k: v for d in outer.values() for k, v in d.items()}
    outer["model.norm.weight"] = mx.ones((args.hidden,), dt)
    per_layer = nbytes(layer_tensors(0, args))  # lazy: shapes only, nothing computed
    layers = args.layers or max(1, round((args.size - nbytes(outer)) / per_layer))
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps(config_for(args, layers, vocab), indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(BUNDLED_MODEL / name, out)
    shards = layers + 1
    weight_map = {}
    total = nbytes(outer) + per_layer * layers
    with tqdm(total=total, unit="B", unit_scale=True, desc="writing") as bar:
        for i in range(shards):
            tensors = outer if i == layers else layer_tensors(i, args)
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            mx.eval(tensors)
            mx.save_safetensors(str(out / shard), tensors, metadata={"format": "mlx"
                                if args.format == "mlx" else "pt"})
            weight_map.update({k: shard for k in tensors})
            bar.update(nbytes(tensors))
            del tensors
            mx.clear_cache()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return layers, total


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--size", type=lambda text: parse_budget(text, 0), default="30GB",
                   help="Total size to reach (e.g. 600MB, 30GB); sets the number of layers")
    p.add_argument("--layers", type=int, default=None, help="Exactly this many (not --size)")
    p.add_argument("--format", choices=("mlx", "hf"), default="mlx")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--moe-intermediate", type=int, default=768)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--router-gain", type=float, default=8.0,
                   help="Router weights' scale: large makes routing decisive")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="Floats, scales and biases (MLX's CPU backend computes bf16 slowly: "
                        "float32 for runs here; a Mac computes either)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.out.exists():
        sys.exit(f"make_large_checkpoint: {args.out} exists; choose a new folder")
    layers, total = write(args.out, args)
    print(f"wrote {args.out}: {args.format}, {layers} layers of {args.experts} experts, "
          f"{total / 1e9:.2f} GB")


if __name__ == "__main__":
    main()
