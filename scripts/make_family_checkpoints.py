"""Write a tiny mlx-lm quantized checkpoint of any MoE family mlx-lm runs.

Each family's config is scripts/families/<family>.json: a small but complete config for
mlx-lm's own `ModelArgs` (several MoE layers, every dimension a multiple of 64 so that
every quantization mode applies). The model is mlx-lm's own class, randomly initialised
by mlx-lm (routers included, so routing varies per token), quantized by mlx-lm's
`quantize_model` and saved by its `save_model`, with a real byte-level BPE tokenizer:
the layout `mlx_lm.convert -q` writes.

    python scripts/make_family_checkpoints.py OUT [--families gpt_oss,glm4_moe,...]
        [--mode affine|mxfp4|mxfp8|nvfp4|none] [--bits 4] [--group-size 64]
        [--global-scale] [--recipe mixed_3_6] [--dtype float32|bfloat16|float16]
"""

import argparse
import json
import sys
from pathlib import Path

FAMILY_DIR = Path(__file__).resolve().parent / "families"


def family_names():
    return sorted(p.stem for p in FAMILY_DIR.glob("*.json"))


def family_config(family: str) -> dict:
    return json.loads((FAMILY_DIR / f"{family}.json").read_text())["config"]


def _randomize_zero_inits(model, seed: int):
    """Routers that mlx-lm initialises to zeros (DeepSeek's MoEGate weight, its score
    correction bias and kin) would route every token alike, and hide those biases; give
    every all-zero weight matrix, and every routing bias, small random values, as a trained
    model has."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    key = mx.random.key(seed)
    updates = []
    for name, value in tree_flatten(model.parameters()):
        routing_bias = value.ndim == 1 and ("correction_bias" in name
                                            or name.endswith(("expert_bias", "router_bias")))
        zero_matrix = value.ndim >= 2 and mx.issubdtype(value.dtype, mx.floating) and \
            not mx.any(value).item()
        if routing_bias or zero_matrix:
            key, sub = mx.random.split(key)
            scale = 0.05 if routing_bias else 0.08
            updates.append((name, scale * mx.random.normal(value.shape, key=sub)))
    if updates:
        model.load_weights(updates, strict=False)


def make_family(family: str, out: Path, mode: str = "affine", bits=None, group_size=None,
                seed: int = 0, global_scale: bool = False, recipe=None,
                dtype: str = "float32") -> Path:
    """`mode` None leaves the model unquantized; `recipe` is one of mlx-lm's mixed
    quantization recipes (mixed_3_6, ...); `dtype` the dtype of every floating weight
    (and so of the quantization scales)."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.convert import mixed_quant_predicate_builder
    from mlx_lm.utils import _get_classes, quantize_model, save_config, save_model

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_test_checkpoints import VOCAB, make_tokenizer

    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(out)
    config = dict(family_config(family), vocab_size=VOCAB,
                  eos_token_id=tokenizer.eos_token_id)
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    _randomize_zero_inits(model, seed)
    if dtype != "float32":
        cast = getattr(mx, dtype)
        model.update(tree_map(
            lambda v: v.astype(cast) if mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters()))
        config["torch_dtype"] = dtype
    mx.eval(model.parameters())
    if mode is not None:
        predicate = recipe and mixed_quant_predicate_builder(recipe, model, group_size or 64)
        model, config = quantize_model(model, config, group_size, bits, mode=mode,
                                       global_scale=global_scale, quant_predicate=predicate)
    save_model(out, model)
    save_config(config, config_path=out / "config.json")
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--families", default=",".join(family_names()))
    parser.add_argument("--mode", default="affine",
                        help="mlx-lm quantization mode; 'none' leaves the model unquantized")
    parser.add_argument("--bits", type=int)
    parser.add_argument("--group-size", type=int)
    parser.add_argument("--global-scale", action="store_true", help="nvfp4's per-expert scale")
    parser.add_argument("--recipe", help="an mlx-lm mixed quantization recipe (mixed_3_6 ...)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    args = parser.parse_args()
    mode = None if args.mode == "none" else args.mode
    for family in args.families.split(","):
        print(family, make_family(family, args.out / family, mode, args.bits, args.group_size,
                                  global_scale=args.global_scale, recipe=args.recipe,
                                  dtype=args.dtype))


if __name__ == "__main__":
    main()
