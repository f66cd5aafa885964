"""Write tiny randomly initialised MoE checkpoints in each supported family's real layout.

For every family this writes two folders under OUT:
  <family>-hf     Hugging Face layout: weights saved by transformers' `save_pretrained`
                  (safetensors shards + model.safetensors.index.json), config.json,
                  and a byte-level BPE tokenizer saved by transformers.
  <family>-mlx4   the same model quantized to int4 (group 64) by `mlx_lm.convert`.

The models are float32: on a CPU, MLX runs fp32 activations and scales far faster than
bf16; `qwen3_moe_bf16` and `qwen3_moe_fp16` are the same model saved
in half precision, as real checkpoints are.

    python scripts/make_test_checkpoints.py OUT [--families qwen3_moe,mixtral,...]
"""

import argparse
import json
import shutil
from pathlib import Path

VOCAB = 512

# Small but complete shapes: every dimension a multiple of 64 so int4 g64 applies,
# several MoE layers, and routed experts well over 80% of all weights.
FAMILIES = {
    "qwen3_moe": dict(
        cls="Qwen3Moe", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=16, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    ),
    "mixtral": dict(
        cls="Mixtral", hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
        num_experts_per_tok=2, tie_word_embeddings=False,
    ),
    "olmoe": dict(
        cls="Olmoe", hidden_size=64, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, num_experts=16,
        num_experts_per_tok=4, norm_topk_prob=False, tie_word_embeddings=False,
    ),
    "deepseek_v3": dict(
        cls="DeepseekV3", hidden_size=64, intermediate_size=128, moe_intermediate_size=64,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=4,
        n_group=4, topk_group=2, topk_method="noaux_tc", scoring_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1,
        q_lora_rank=64, kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32,
        v_head_dim=32, tie_word_embeddings=False,
    ),
    # A larger Qwen3-MoE for memory tests: weights dominate activations and KV cache.
    "qwen3_moe_large": dict(
        cls="Qwen3Moe", hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        num_experts=32, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False,
    ),
}
# Real checkpoints are bf16 or fp16: the same small Qwen3-MoE saved in each, so that
# conversion's casts, bf16 slot storage and half-precision scales are tested exactly.
FAMILIES["qwen3_moe_bf16"] = dict(FAMILIES["qwen3_moe"], dtype="bfloat16")
FAMILIES["qwen3_moe_fp16"] = dict(FAMILIES["qwen3_moe"], dtype="float16")
DEFAULT_FAMILIES = ["qwen3_moe", "mixtral", "olmoe", "deepseek_v3"]
HALF_FAMILIES = ["qwen3_moe_bf16", "qwen3_moe_fp16"]

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer(out: Path):
    """A real byte-level BPE tokenizer, trained on a little of Python's own docs."""
    import pydoc

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = [pydoc.getdoc(obj) for obj in (json, shutil, argparse, Path, dict, str, list)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return fast


def hub_config(config_path: Path, family: str, dtype: str = "float32"):
    """Rewrite config.json with the keys the model's authors publish on the hub.

    transformers 5 writes `num_local_experts` and `rope_parameters`; real checkpoints
    (and mlx-lm, which reads them) use `num_experts` and `rope_theta`.
    """
    cfg = json.loads(config_path.read_text())
    rope = cfg.pop("rope_parameters", None) or {}
    cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    cfg["rope_scaling"] = None
    if family.startswith("qwen3_moe") or family == "olmoe":
        cfg["num_experts"] = cfg.pop("num_local_experts", cfg.get("num_experts"))
    cfg["torch_dtype"] = dtype
    config_path.write_text(json.dumps(cfg, indent=2))


def make_hf(family: str, out: Path, seed: int = 0):
    import torch
    import transformers

    spec = dict(FAMILIES[family])
    name = spec.pop("cls")
    dtype = spec.pop("dtype", "float32")
    torch.manual_seed(seed)
    tokenizer = make_tokenizer(out)
    config = getattr(transformers, f"{name}Config")(
        vocab_size=VOCAB, max_position_embeddings=1024, bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **spec
    )
    model = getattr(transformers, f"{name}ForCausalLM")(config).float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.05)  # zeros would hide the correction in group routing
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)  # large enough that the routing varies per token
    model.to(getattr(torch, dtype)).save_pretrained(out, max_shard_size="1MB")
    hub_config(out / "config.json", family, dtype)


def make_mlx(hf: Path, out: Path):
    from mlx_lm.convert import convert

    convert(str(hf), str(out), quantize=True, q_bits=4, q_group_size=64)


def make_all(out: Path, families=DEFAULT_FAMILIES, quantized=True):
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for family in families:
        hf, mlx = out / f"{family}-hf", out / f"{family}-mlx4"
        if not (hf / "config.json").exists():
            make_hf(family, hf)
        if quantized and not (mlx / "config.json").exists():
            make_mlx(hf, mlx)
        paths[family] = (hf, mlx)
    return paths


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--families", default=",".join(DEFAULT_FAMILIES))
    args = parser.parse_args()
    for family, (hf, mlx) in make_all(args.out, args.families.split(",")).items():
        print(f"{family}: {hf} {mlx}")


if __name__ == "__main__":
    main()
