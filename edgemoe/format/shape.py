"""Shape arithmetic before allocation: a config.json is sized from its numbers alone,
before anything is built from it.

Every tool builds mlx-lm's model for a config (doctor, generate, convert and the server
build the same skeleton), and building it costs time and memory in proportion to what
the config claims: a config.json saying `num_hidden_layers: 100000` took 101 s and 11 GB
before failing elsewhere. `check_shape` reads the fields that size a model, each of which
must be a whole number in a range no real model leaves, and multiplies them out: an
impossible shape is one line naming the field, in microseconds.
"""

from typing import Optional

# (names a family may give the field, its largest plausible value); the largest real
# models have ~130 decoder layers, hidden 16k-32k, 512 experts, 262k vocabularies
FIELDS = {
    "layers": (("num_hidden_layers", "num_layers", "n_layers", "n_layer"), 1 << 12),
    "hidden": (("hidden_size", "model_dim", "d_model", "n_embd"), 1 << 17),
    "experts": (("num_experts", "num_local_experts", "n_routed_experts"), 1 << 14),
    "top_k": (("num_experts_per_tok", "num_experts_per_token", "experts_per_token"), 1 << 14),
    "expert_width": (("moe_intermediate_size",), 1 << 20),
    "width": (("intermediate_size", "ffn_dim"), 1 << 20),
    "vocab": (("vocab_size",), 1 << 23),
    "heads": (("num_attention_heads", "num_heads", "n_heads", "n_head"), 1 << 14),
    "kv_heads": (("num_key_value_heads", "num_kv_heads"), 1 << 14),
    "head_dim": (("head_dim",), 1 << 16),
}
MAX_PARAMETERS = 10 ** 14  # 100 T: 50x the largest open model


class ShapeError(ValueError):
    """A config.json whose numbers no model has: one line naming the field."""


def _whole(config: dict, names, largest: int, where) -> Optional[int]:
    """The first of `names` the config gives, checked: a whole number in 1..largest (or a
    list of them, one per layer, as hunyuan's widths: the largest)."""
    for name in names:
        value = config.get(name)
        if value is None:
            continue
        values = value if isinstance(value, list) and 0 < len(value) <= 1 << 12 else [value]
        for v in values:
            if not isinstance(v, int) or isinstance(v, bool):
                raise ShapeError(f"{where}: {name} must be a whole number, found "
                                 f"{_show(value)} ({type(v).__name__})")
            if not 1 <= v <= largest:
                raise ShapeError(f"{where}: {name} is {_show(v)}, expected 1 to {largest}: "
                                 f"no model has that shape")
        return max(values)
    return None


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 24 else text[:10] + f"...({len(text)} characters)"


def check_shape(config: dict, where) -> int:
    """The parameter count a config implies (an estimate from its main fields), after
    checking each field that sizes the model; a ShapeError names the first impossible
    one. Cheap whatever the config claims: nothing is built."""
    text = {**config, **(config.get("text_config") or {})}
    found = {key: _whole(text, names, largest, where)
             for key, (names, largest) in FIELDS.items()}
    experts, top_k = found["experts"], found["top_k"]
    if experts is not None and top_k is not None and top_k > experts:
        name = next(n for n in FIELDS["top_k"][0] if n in text)
        raise ShapeError(f"{where}: {name} is {top_k}, more than the {experts} experts")
    layers, hidden = found["layers"] or 1, found["hidden"] or 1
    width = found["expert_width"] or found["width"] or 4 * hidden
    per_layer = 4 * hidden * hidden + 3 * hidden * width * (experts or 1)
    parameters = layers * per_layer + 2 * hidden * (found["vocab"] or 1)
    if parameters > MAX_PARAMETERS:
        raise ShapeError(f"{where}: its shape implies {parameters:.3g} parameters (layers "
                         f"{layers}, hidden {hidden}, experts {experts or 1} of width "
                         f"{width}), more than any model ({MAX_PARAMETERS:.0e})")
    return parameters
