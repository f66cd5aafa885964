"""Check every MoE family of the pinned mlx-lm against mlx-lm itself; write docs/families.md's tables.

For each family (scripts/families/<family>.json) this builds a tiny int4 checkpoint with
mlx-lm's own classes (make_family_checkpoints), converts it to a pack, trains prerouter
heads for a few steps with edgemoe.train_prerouter, and checks, against mlx-lm's own model
on the same checkpoint (a 40-token prompt, 32 greedy tokens):

- exact: the same tokens and bit-identical logits in the four configurations of CHECKS,
  which cover the pack and in place, native and advisory modes, and budgets 100%, 25% (or
  the minimum, where 25% is below it) and the minimum (advisory: the next layer's
  router);
- routing: each MoE block, routed by its own code from its native router logits given as
  a prediction, gives its native output bit for bit, and other logits route elsewhere;
- prerouted: decode with the heads never loads on demand in a predicted layer;
- HF layout (the families transformers can save and mlx-lm reads that way,
  make_hf_family_checkpoints): the transformers checkpoint converted by edgemoe.convert
  streams at the minimum budget exactly as mlx-lm runs `mlx_lm.convert -q` of it.

tests/test_families.py runs the same checks and fails when docs/families.md's tables differ.

    python scripts/family_table.py [--families a,b] [--write]
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from make_family_checkpoints import family_config, family_names, make_family  # noqa: E402
from make_hf_family_checkpoints import HF_FAMILIES, make_hf_family  # noqa: E402

PROMPT, DECODE = 40, 32
# (source, routing mode, budget): each source and each mode at two budgets, each budget at
# least once, the smallest (where slots overflow most) on both sources. The whole cross
# product (12 loads per family) passed for every family too, when it was run; these four keep
# the suite within its time.
CHECKS = [("pack", "native", "100%"), ("pack", "advisory", "minimum"),
          ("in place", "native", "minimum"), ("in place", "advisory", "25%")]


def supported_families():
    """Every family with a config here, but those edgemoe knows it cannot stream."""
    from edgemoe.format.families import UNSUPPORTED

    return [f for f in family_names() if family_config(f)["model_type"] not in UNSUPPORTED]


def greedy(model, tokens):
    """Prefill then greedy decode: the tokens and the logits of every step."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    out = model(tokens[None], cache=cache)
    logits, generated = [out[0, -1]], []
    for _ in range(DECODE):
        generated.append(mx.argmax(out[:, -1], -1))
        out = model(generated[-1][None], cache=cache)
        logits.append(out[0, -1])
    return [int(t.item()) for t in generated], mx.stack(logits)


def routing_is_the_blocks_own(model) -> bool:
    """Native logits as a prediction give each block's native output bit for bit."""
    import mlx.core as mx

    from edgemoe.mlx_backend.gates import hidden_size, install_tap, moe_blocks, tapped

    def output(block, x):  # a block may be a whole decoder layer (gemma4): (h, kv, offset)
        out = block(x)
        return out[0] if isinstance(out, tuple) else out

    for layer, block in moe_blocks(model).items():
        x = 4 * mx.random.normal((1, 9, hidden_size(block)), key=mx.random.key(layer))
        with tapped(block) as tap:  # the logits the block's router computed, natively
            native = output(block, x)
            logits = tap.recorded
        tap = install_tap(block)
        tap.set_prediction(logits)
        same = mx.array_equal(output(block, x), native).item()
        tap.set_prediction(-logits)
        other = not mx.array_equal(output(block, x), native).item()
        if not (same and other and mx.array_equal(output(block, x), native).item()):
            return False
    return True


def train_heads(checkpoint: Path, out: Path) -> Path:
    from edgemoe import train_prerouter

    text = out / "text.txt"
    text.parent.mkdir(parents=True, exist_ok=True)
    text.write_text(Path(train_prerouter.__file__).read_text())  # any text will do
    args = argparse.Namespace(
        model=str(checkpoint), data=str(text), out=str(out), eval_data=None, hidden=32,
        epochs=1, seed=0, same_token=False, native_layers="", context=32, batch_size=16,
        lr=1e-3, max_steps=4, max_train_tokens=600, max_eval_tokens=0)
    train_prerouter.run(args)
    return out / "prerouter"


def prerouted_never_loads_on_demand(path: Path, heads: Path, budget, tokens) -> bool:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import edgemoe
    from edgemoe.mlx_backend.prerouter import load_prerouter

    model, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                            prerouter_path=heads)
    cache = make_prompt_cache(model)
    out = model(tokens[None], cache=cache)
    store = model.expert_store
    before = store.on_demand_by_layer()
    for _ in range(16):
        out = model(mx.argmax(out[:, -1], -1)[None], cache=cache)
    mx.eval(out)
    after = store.on_demand_by_layer()
    predicted = load_prerouter(heads).config.predicted_layers
    return bool(predicted) and all(after[l] == before[l] for l in predicted) and \
        store.snapshot().prefetches > 0


def check_family(family: str, work: Path) -> dict:
    """Build, convert and check one family; the row of the table (see the module doc)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm import load as mlx_lm_load

    import edgemoe
    from edgemoe.convert import convert
    from edgemoe.format.source import open_source
    from edgemoe.streaming.budget import minimum_bytes

    checkpoint = make_family(family, work / family)
    pack = convert(checkpoint, work / f"{family}-pack")
    heads = train_heads(checkpoint, work / f"{family}-heads")
    tokens = mx.array(np.random.default_rng(7).integers(3, 500, PROMPT))
    reference, _ = mlx_lm_load(str(checkpoint))
    expected_tokens, expected_logits = greedy(reference, tokens)
    source = open_source(pack)
    row = {"family": family, "module": source.layers[0].module,
           "moe_layers": len(source.layers), "experts": source.layers[0].num_experts,
           "top_k": source.top_k, "quantization": _quantization(source), "exact": {}}
    minimum = minimum_bytes(source)
    budgets = {"100%": 1.0, "25%": max(int(0.25 * source.expert_bytes), minimum),
               "minimum": minimum}
    paths = {"pack": pack, "in place": checkpoint}
    for name, mode, label in CHECKS:
        model, _ = edgemoe.load(paths[name], expert_budget=budgets[label], routing=mode)
        if mode == "advisory":  # read every prediction ahead, right or not: still exact
            model.expert_store.gate_prefetches(False)
        got_tokens, got_logits = greedy(model, tokens)
        model.expert_store.close()
        row["exact"][f"{name}/{mode}/{label}"] = (
            got_tokens == expected_tokens
            and mx.array_equal(got_logits, expected_logits).item())
    row["speculative"] = speculates_as_mlx_lm(reference, pack, minimum, tokens)
    row["routing"] = routing_is_the_blocks_own(reference)
    row["prerouted"] = prerouted_never_loads_on_demand(pack, heads, minimum, tokens)
    row["hf"] = hf_layout_is_exact(family, work, tokens) if family in HF_FAMILIES else None
    return row


def speculates_as_mlx_lm(reference, pack: Path, budget: int, tokens):
    """Speculative decoding through mlx-lm's own loop, the model itself as the draft (so
    every window verifies a draft and mlx-lm's next step): the pack streamed at `budget`
    gives mlx-lm's tokens, drafted-or-not and logprobs bit for bit. None where mlx-lm cannot
    speculate (a cache it cannot trim: recurrent or rotating layers)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache

    import edgemoe

    if not can_trim_prompt_cache(make_prompt_cache(reference)):
        return None

    def run(model):
        return [(int(t), d, lp) for t, lp, d in speculative_generate_step(
            tokens, model, reference, num_draft_tokens=3, max_tokens=DECODE)]

    expected = run(reference)
    model, _ = edgemoe.load(pack, expert_budget=budget)
    got = run(model)
    model.expert_store.close()
    return [(t, d) for t, d, _ in got] == [(t, d) for t, d, _ in expected] and all(
        mx.array_equal(a, b).item() for (_, _, a), (_, _, b) in zip(got, expected))


def hf_layout_is_exact(family: str, work: Path, tokens) -> bool:
    """The family saved by transformers (Hugging Face layout, one tensor per expert),
    converted by edgemoe.convert, streams at its minimum budget exactly as mlx-lm runs
    what `mlx_lm.convert -q` makes of the same folder."""
    import mlx.core as mx
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.convert import convert as mlx_lm_convert

    import edgemoe
    from edgemoe.convert import convert
    from edgemoe.format.source import open_source
    from edgemoe.streaming.budget import minimum_bytes

    hf = make_hf_family(family, work / f"{family}-hf")
    mlx = work / f"{family}-hf-mlx4"
    mlx_lm_convert(str(hf), str(mlx), quantize=True, q_bits=4, q_group_size=64)
    pack = convert(hf, work / f"{family}-hf-pack")
    expected = greedy(mlx_lm_load(str(mlx))[0], tokens)
    model, _ = edgemoe.load(pack, expert_budget=minimum_bytes(open_source(pack)))
    got = greedy(model, tokens)
    model.expert_store.close()
    return got[0] == expected[0] and mx.array_equal(got[1], expected[1]).item()


# every expert quantization mlx-lm writes, on one family: (name, make_family options)
QUANT_FAMILY = "qwen3_moe"
QUANT_SPECS = [(f"affine {b}-bit g{g}", dict(mode="affine", bits=b, group_size=g))
               for b, g in ((2, 64), (3, 64), (4, 32), (5, 64), (6, 64), (8, 64))] + [
    ("mxfp4", dict(mode="mxfp4")), ("mxfp8", dict(mode="mxfp8")), ("nvfp4", dict(mode="nvfp4")),
    ("nvfp4 + global scale", dict(mode="nvfp4", global_scale=True)),
    ("mixed_3_6 recipe", dict(mode="affine", recipe="mixed_3_6")),
    ("affine 4-bit, bf16 scales", dict(mode="affine", dtype="bfloat16")),
    ("affine 4-bit, fp16 scales", dict(mode="affine", dtype="float16")),
    ("unquantized (fp32)", dict(mode=None)),
]


def check_quantization(name: str, work: Path) -> dict:
    """Like check_family, native routing, for the quantization `name` of QUANT_SPECS on
    QUANT_FAMILY; where MLX cannot compute the mode here (nvfp4's global scale needs a
    GPU), the streamed pools' tensors are checked against mlx-lm's own modules instead."""
    import mlx.core as mx
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm import load as mlx_lm_load

    import edgemoe
    from edgemoe.convert import convert
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.experts import expert_modules
    from edgemoe.mlx_backend.families import find_experts
    from edgemoe.streaming.budget import minimum_bytes

    options = dict(QUANT_SPECS)[name]
    folder = work / name.replace(" ", "_").replace(",", "").replace("+", "")
    checkpoint = make_family(QUANT_FAMILY, folder, **options)
    pack = convert(checkpoint, f"{folder}-pack", quantize=options.get("mode") is not None)
    reference, _ = mlx_lm_load(str(checkpoint))
    computes = not options.get("global_scale") or mx.default_device() == mx.gpu
    tokens = mx.array(np.random.default_rng(7).integers(3, 500, PROMPT))
    expected = greedy(reference, tokens) if computes else None
    shapes = {p: {k: v.shape for k, v in tree_flatten(m.parameters())}
              for p, m in expert_modules(reference).items()}
    row = {"name": name, "manifest": _quantization(open_source(pack)), "computed": computes,
           "exact": {}}
    for source, path in (("pack", pack), ("in place", checkpoint)):
        for label in ("100%", "minimum"):
            budget = 1.0 if label == "100%" else minimum_bytes(
                open_source(path, find_experts=find_experts))
            model, _ = edgemoe.load(path, expert_budget=budget)
            if computes:
                got = greedy(model, tokens)
                same = got[0] == expected[0] and mx.array_equal(got[1], expected[1]).item()
            else:  # the pools hold the same tensors mlx-lm's modules would, per slot
                pools = {p: {k: v.shape[1:] for k, v in tree_flatten(m.pool.module.parameters())}
                         for p, m in _streaming_modules(model).items()}
                same = pools == {p: {k: v[1:] for k, v in t.items()} for p, t in shapes.items()}
            model.expert_store.close()
            row["exact"][f"{source}/{label}"] = same
    return row


def _streaming_modules(model):
    from edgemoe.mlx_backend.experts import StreamingExperts

    return {p: m for p, m in model.named_modules() if isinstance(m, StreamingExperts)}


def render_quant_table(rows) -> str:
    lines = [f"| experts quantized as (`{QUANT_FAMILY}`) | pack manifest | pack | in place "
             "| exact |", "|---|---|---|---|---|"]
    for row in rows:
        exact = row["exact"]

        def ok(part):
            return "yes" if all(v for k, v in exact.items() if k.startswith(part)) else "NO"

        verdict = ("bit-identical" if row["computed"] else
                   "tensors as mlx-lm's (MLX computes it only on a GPU)")
        lines.append(f"| {row['name']} | {row['manifest']} | {ok('pack')} | {ok('in place')} "
                     f"| {verdict if all(exact.values()) else 'NO'} |")
    return "\n".join(lines)


def _quantization(source) -> str:
    modes = sorted({f"{q['mode']} {q['bits']}-bit g{q['group_size']}"
                    + (" + global scale" if q.get("global_scale") else "")
                    for layer in source.layers for q in layer.quantization.values() if q})
    return ", ".join(modes) or "none"


def passed(row: dict) -> bool:
    return all(row["exact"].values()) and row["routing"] and row["prerouted"] and \
        row["hf"] is not False and row["speculative"] is not False


def render_table(rows) -> str:
    lines = ["| family (mlx-lm model file) | routed experts | pack | in place | native | advisory "
             "| prerouted | speculative | HF layout | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        exact = row["exact"]

        def ok(part):
            return "yes" if all(v for k, v in exact.items() if part in k.split("/")) else "NO"

        lines.append(
            f"| `{row['family']}` | {row['moe_layers']} layers x {row['experts']}, top-"
            f"{row['top_k']} (`{row['module']}`) | {ok('pack')} | {ok('in place')} "
            f"| {ok('native')} | {ok('advisory')} | "
            f"{'yes' if row['prerouted'] else 'NO'} | "
            f"{ {True: 'yes', False: 'NO', None: '-'}[row['speculative']]} | "
            f"{ {True: 'yes', False: 'NO', None: '-'}[row['hf']]} | "
            f"{'bit-identical' if passed(row) else 'NO'} |")
    from edgemoe.format.families import UNSUPPORTED

    for family, reason in sorted(UNSUPPORTED.items()):
        lines.append(f"| `{family}` | refused: {reason} | | | | | | | | no |")
    return "\n".join(lines)


def _markers(name: str):
    return f"<!-- {name}-table:start -->", f"<!-- {name}-table:end -->"


TABLES_DOC = ROOT / "docs" / "families.md"  # where the generated tables live


def readme_table(readme: Path, name: str) -> str:
    """The document's table `name` ("family" or "quantization"), between its markers."""
    text = readme.read_text()
    start, end = _markers(name)
    return text[text.index(start) + len(start):text.index(end)].strip()


def write_readme(readme: Path, name: str, table: str):
    text = readme.read_text()
    start, end = _markers(name)
    head, tail = text.index(start) + len(start), text.index(end)
    readme.write_text(text[:head] + "\n" + table + "\n" + text[tail:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=",".join(supported_families()))
    parser.add_argument("--write", "--write-readme", dest="write", action="store_true",
                        help="write both tables into docs/families.md (with every family)")
    args = parser.parse_args()
    rows, quant_rows = [], []
    with tempfile.TemporaryDirectory() as work:
        for family in args.families.split(","):
            rows.append(check_family(family, Path(work)))
            print(json.dumps(rows[-1]), flush=True)
        for name, _ in QUANT_SPECS:
            quant_rows.append(check_quantization(name, Path(work)))
            print(json.dumps(quant_rows[-1]), flush=True)
    tables = {"family": render_table(rows), "quantization": render_quant_table(quant_rows)}
    for name, table in tables.items():
        print(table)
        if args.write:
            write_readme(TABLES_DOC, name, table)


if __name__ == "__main__":
    main()
