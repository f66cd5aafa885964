"""A pack's layout against its config.json: the fields that decide routing and shapes
(recorded in the manifest at convert, compared at open), and each layer's expert count,
top-k, quantization, dtypes and widths."""

import json
from pathlib import Path

from .records import PackError

CONFIG = "config.json"
# what decides routing and shapes: compared with what the manifest holds at load
ROUTING_FIELDS = ("model_type", "num_experts_per_tok", "num_experts", "num_local_experts",
                  "n_routed_experts", "moe_intermediate_size", "intermediate_size",
                  "hidden_size", "num_hidden_layers", "first_k_dense_replace",
                  "decoder_sparse_step", "mlp_only_layers", "moe_layer_freq",
                  "num_experts_per_token", "experts_per_token", "n_group", "topk_group",
                  "norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method",
                  "quantization")


def config_fields(config: dict) -> dict:
    """The config.json fields that decide routing and shapes (of the text model)."""
    text = {**config, **(config.get("text_config") or {})}
    return {k: text[k] for k in ROUTING_FIELDS if k in text}


FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def check_against_config(pack, config: dict, manifest_path: Path):
    """The manifest's layout against config.json: each layer's expert count, top-k, the
    quantization of each projection (bits, group size, mode), dtypes a quantized or
    float weight can have, scales that fit their weight, and widths the config declares."""
    from .shape import FIELDS

    text = {**config, **(config.get("text_config") or {})}
    cfg = pack.path / CONFIG

    def declared(key):
        name = next((n for n in FIELDS[key][0] if isinstance(text.get(n), int)), None)
        return (name, text[name]) if name else (None, None)

    name, top_k = declared("top_k")
    if top_k is not None and pack.top_k != top_k:
        raise PackError(f"{cfg}: routes {top_k} experts per token, the pack was written for "
                        f"{pack.top_k} (manifest top_k; config.json's {name}); restore "
                        f"config.json or convert the checkpoint again")
    name, experts = declared("experts")
    widths = {v for k, v in text.items() if isinstance(v, int) and not isinstance(v, bool)
              and (k.endswith(("_size", "_dim")) or k in ("d_model", "n_embd"))}
    for layer in pack.layers:
        where = f"{manifest_path}: layer {layer.index}"
        if experts is not None and layer.num_experts != experts:
            raise PackError(f"{where}: {layer.num_experts} expert records, {cfg} has "
                            f"{experts} experts ({name}); convert the checkpoint again")
        parts = {}
        for t in layer.tensors:
            parts.setdefault(t.projection, {})[t.kind] = t
        for projection, kinds in parts.items():
            q = layer.quantization.get(projection)
            _check_quantization(q, text.get("quantization"), layer.module, projection,
                                f"{where} {projection}", cfg)
            _check_projection(kinds, q, widths, f"{where} {projection}", cfg)


def _check_quantization(q, recipe, module: str, projection: str, where: str, cfg: Path):
    """A projection's quantization against config.json's recipe (mlx-lm's: a default and
    per-module entries)."""
    if q is None:
        return
    if not isinstance(recipe, dict):
        raise PackError(f"{where}: quantized ({q.get('bits')} bits), {cfg} is not; convert "
                        f"the checkpoint again")
    want = recipe.get(f"{module}.{projection}", recipe)
    for key in ("bits", "group_size"):
        if not isinstance(q.get(key), int) or isinstance(q.get(key), bool) or q[key] <= 0:
            raise PackError(f"{where}: quantization {key} {json.dumps(q.get(key))[:20]}, "
                            f"expected a positive whole number")
        if not isinstance(want, dict) or q[key] != want.get(key):
            found = want.get(key) if isinstance(want, dict) else want
            raise PackError(f"{where}: quantization {key} {q[key]}, {cfg} says {found}; "
                            f"convert the checkpoint again")
    if q.get("mode", "affine") != want.get("mode", "affine"):
        raise PackError(f"{where}: quantization mode {q.get('mode')!r}, {cfg} says "
                        f"{want.get('mode', 'affine')!r}; convert the checkpoint again")


def _check_projection(kinds: dict, q, widths: set, where: str, cfg: Path):
    """A projection's dtypes and shapes: a quantized weight is uint32 with scales (and
    biases) of its rows and groups, a float one a float; its widths the config's."""
    weight = kinds.get("weight")
    if weight is None or len(weight.shape) < 2:
        return
    out_features = weight.shape[0]
    if q is None:
        if weight.dtype not in FLOAT_DTYPES:
            raise PackError(f"{where}.weight: dtype {weight.dtype}, expected a float "
                            f"({', '.join(FLOAT_DTYPES)}) for an unquantized weight")
        in_features = weight.shape[-1]
    else:
        if weight.dtype != "uint32":
            raise PackError(f"{where}.weight: dtype {weight.dtype}, expected uint32 for a "
                            f"{q['bits']}-bit quantized weight")
        in_features = weight.shape[-1] * 32 // q["bits"]
        scale_dtypes = FLOAT_DTYPES if q.get("mode", "affine") == "affine" else \
            FLOAT_DTYPES + ("uint8",)
        expected = (out_features, in_features // q["group_size"])
        for kind in ("scales", "biases"):
            t = kinds.get(kind)
            if t is None:
                if kind == "scales":
                    raise PackError(f"{where}: quantized without scales")
                continue
            if t.dtype not in scale_dtypes:
                raise PackError(f"{where}.{kind}: dtype {t.dtype}, expected one of "
                                f"{', '.join(scale_dtypes)}")
            if tuple(t.shape) != expected:
                raise PackError(f"{where}.{kind}: shape {list(t.shape)}, expected "
                                f"{list(expected)} for a {q['bits']}-bit weight of shape "
                                f"{list(weight.shape)} in groups of {q['group_size']}")
    if widths and not {out_features, in_features} & widths:
        raise PackError(f"{where}.weight: maps {in_features} to {out_features} features, "
                        f"neither a width {cfg} declares (hidden_size "
                        f"{next(iter(sorted(widths)), '?')}...); convert the checkpoint again")
