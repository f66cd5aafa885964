"""prerouter_config.json, as both backends read it (neither MLX nor PyTorch here).

Heads saved before the head variants left (#44; their figures: docs/benchmarks.md,
"Variants") record each variant's field; the shipped heads hold the plain values. A
field of a removed variant loads at its plain value only.
"""

# a removed variant's field -> its plain value
RETIRED = {"head_hidden": 256, "first_layer": False, "history": 1, "inputs": 1, "depth": 1}
HEAD_HIDDEN = RETIRED["head_hidden"]  # the width of every head


def current_fields(raw: dict, path) -> dict:
    """`raw`, the JSON of `path`, without the removed variants' fields; one at another
    value than its plain one is a ValueError naming the file and the field."""
    for name, plain in RETIRED.items():
        if name in raw and raw[name] != plain:
            raise ValueError(f"{path}: {name} {raw[name]!r}: heads of a variant removed in "
                             f"#44 (docs/benchmarks.md); only {name} {plain!r} loads")
    return {k: v for k, v in raw.items() if k not in RETIRED}
