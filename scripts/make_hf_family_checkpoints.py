"""Write a tiny Hugging Face checkpoint, as transformers saves it, of the MoE families that
mlx-lm also reads in that layout.

Each family's mlx-lm config (scripts/families/<family>.json) is given, as it is, to
transformers' `AutoConfig.for_model`; `AutoModelForCausalLM.from_config` builds the model,
whose matrices are drawn from N(0, 0.08) (routing biases from N(0, 0.05)) as in
make_test_checkpoints.make_hf, and `save_pretrained` writes it in float32 (1 MB shards),
with make_test_checkpoints' byte-level BPE tokenizer. Where the checkpoint would exceed
2 MiB the routed experts are halved (top-k halved too where the routing would no longer
be sparse), so every checkpoint stays under 2 MiB. config.json then carries our own
keys over transformers' (rope_parameters dropped where ours has none, as
make_test_checkpoints.hub_config does), so that mlx-lm reads the model transformers built.

`HF_FAMILIES` are those for which, with the pinned transformers and mlx-lm,
`mlx_lm.convert -q` (int4, group 64) reads the folder, `edgemoe.convert` converts it, and
edgemoe at its minimum expert budget decodes greedily with logits bit-identical to
mlx-lm's on the mlx_lm.convert output. Other families fail one of those steps (a
model_type transformers lacks, a config AutoModelForCausalLM does not build, or weights
that mlx-lm's sanitize does not take as transformers saves them).

    python scripts/make_hf_family_checkpoints.py OUT [--families qwen3_moe,mixtral,...]
"""

import argparse
import copy
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_family_checkpoints import family_config  # noqa: E402
from make_test_checkpoints import VOCAB, make_tokenizer  # noqa: E402

HF_FAMILIES = [
    "afmoe", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1", "ernie4_5_moe",
    "exaone_moe", "gemma4_text", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe",
    "granitemoehybrid", "jamba", "laguna", "lfm2_moe", "mellum", "mixtral", "nemotron_h",
    "olmoe", "phimoe", "qwen2_moe", "qwen3_moe", "qwen3_next", "solar_open",
]

MAX_BYTES = 2 * 1024 * 1024
_WEIGHT_BYTES = MAX_BYTES - 64 * 1024  # room for the tokenizer, configs and shard index
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_k", "experts_per_token")
_ROUTING_BIASES = ("e_score_correction_bias", "expert_bias")


def _text(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def _halve_experts(cfg: dict) -> bool:
    """Halve the routed experts in place (and top-k where fewer than 2 * top-k would be
    left), keeping expert groups of two or more; False where nothing can be halved."""
    d = _text(cfg)
    keys = [k for k in _EXPERT_KEYS if isinstance(d.get(k), int)]
    top_keys = [k for k in _TOP_K_KEYS if isinstance(d.get(k), int)]
    if not keys:
        return False
    n, k = d[keys[0]] // 2, max([d[t] for t in top_keys] or [1])
    groups = d.get("n_group") or 1
    if n % groups or n // groups < 2:
        return False
    if n < 2 * k:
        if k < 2 or n < k:
            return False
        k //= 2
        for t in top_keys:
            d[t] = k
    for key in keys:
        d[key] = n
    return True


def _build(ours: dict, tokenizer):
    import transformers

    cfg = copy.deepcopy(ours)
    config = transformers.AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    config.bos_token_id = None
    return transformers.AutoModelForCausalLM.from_config(config).float()


def _weight_bytes(model) -> int:
    return sum(v.numel() * v.element_size() for v in model.state_dict().values())


def _config_json(written: dict, ours: dict) -> dict:
    """transformers' config.json with our keys over it (nested *_config merged)."""
    if "rope_parameters" in written and "rope_parameters" not in ours:
        written.pop("rope_parameters")
    for key, value in ours.items():
        if key.endswith("_config") and isinstance(value, dict) and \
                isinstance(written.get(key), dict):
            written[key] = _config_json(written[key], value)
        else:
            written[key] = value
    return written


def make_hf_family(family: str, out, seed: int = 0) -> Path:
    """Build `family` with transformers and save it, Hugging Face layout, under `out`."""
    import torch

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    ours = copy.deepcopy(family_config(family))
    ours["vocab_size"] = VOCAB
    if isinstance(ours.get("text_config"), dict):
        ours["text_config"]["vocab_size"] = VOCAB
    tokenizer = make_tokenizer(out)
    model = _build(ours, tokenizer)
    while _weight_bytes(model) > _WEIGHT_BYTES and _halve_experts(ours):
        model = _build(ours, tokenizer)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(_ROUTING_BIASES):
                p.normal_(0.0, 0.05)  # zeros would hide the bias in the routing
            elif p.dim() >= 2:
                p.normal_(0.0, 0.08)  # large enough that the routing varies per token
        for name, b in model.named_buffers():
            if name.endswith(_ROUTING_BIASES) and b.is_floating_point():
                b.normal_(0.0, 0.05)
    model.save_pretrained(out, max_shard_size="1MB")
    path = out / "config.json"
    config = _config_json(json.loads(path.read_text()), ours)
    config["torch_dtype"] = "float32"
    path.write_text(json.dumps(config, indent=2))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--families", default=",".join(HF_FAMILIES))
    args = parser.parse_args()
    for family in args.families.split(","):
        print(family, make_hf_family(family, args.out / f"{family}-hf"))


if __name__ == "__main__":
    main()
