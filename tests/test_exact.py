"""Native routing through the expert store gives mlx-lm's tokens and logits, bit for bit."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.format.pack import Pack
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402

from conftest import FAMILIES, HALF_FAMILIES

EXACT = FAMILIES + HALF_FAMILIES  # every family, and the half-precision checkpoints

PROMPT_LEN, DECODE = 64, 32


def prompt(vocab=500):
    return mx.array(np.random.default_rng(7).integers(3, vocab, PROMPT_LEN))


def greedy_logits(model, tokens):
    """Prefill then greedy decode; the logits of the prompt and of every step."""
    cache = make_prompt_cache(model)
    out = model(tokens[None], cache=cache)
    logits = [out[0]]
    for _ in range(DECODE):
        out = model(mx.argmax(out[:, -1], -1)[None], cache=cache)
        logits.append(out[0])
    return mx.concatenate(logits)


def forced_logits(model, tokens):
    """Decode one given token at a time, so routing varies at every step."""
    cache = make_prompt_cache(model)
    return mx.concatenate([model(t.reshape(1, 1), cache=cache)[0] for t in tokens[:24]])


def mlx_lm_tokens(model, tokens):
    gen = generate_step(tokens, model, max_tokens=DECODE, sampler=make_sampler(0.0))
    return [int(t) for t, _ in gen]


def budgets(pack_path):
    return {"100%": 1.0, "50%": 0.5,
            "minimum": minimum_bytes(Pack.open(pack_path))}


@pytest.fixture(scope="module")
def reference(checkpoints):
    """mlx-lm's own model on the mlx-lm int4 checkpoint, per family."""
    cache = {}

    def get(family):
        if family not in cache:
            model, _ = mlx_lm_load(str(checkpoints[family][1]))
            tokens = prompt()
            cache[family] = (model, mlx_lm_tokens(model, tokens),
                             greedy_logits(model, tokens), forced_logits(model, tokens))
        return cache[family]

    return get


@pytest.mark.parametrize("budget", ["100%", "50%", "minimum"])
@pytest.mark.parametrize("family", EXACT)
def test_same_tokens_and_logits_as_mlx_lm(family, budget, packs, reference):
    _, ref_tokens, ref_logits, ref_forced = reference(family)
    path = packs[family]["hf"]
    model, _ = edgemoe.load(path, expert_budget=budgets(path)[budget])
    tokens = prompt()
    assert mlx_lm_tokens(model, tokens) == ref_tokens
    assert mx.array_equal(greedy_logits(model, tokens), ref_logits).item()
    assert mx.array_equal(forced_logits(model, tokens), ref_forced).item()
    stats = model.expert_store.stats
    if budget != "100%":
        assert stats.evictions > 0, "a small budget must have evicted experts"


@pytest.mark.parametrize("family", EXACT)
def test_pack_from_mlx_lm_checkpoint_is_exact_too(family, packs, reference):
    _, ref_tokens, ref_logits, _ = reference(family)
    model, _ = edgemoe.load(packs[family]["mlx"], expert_budget=0.5)
    tokens = prompt()
    assert mlx_lm_tokens(model, tokens) == ref_tokens
    assert mx.array_equal(greedy_logits(model, tokens), ref_logits).item()


def test_routing_varies_so_the_test_means_something(packs):
    """The random test models must spread tokens over experts, or eviction is untested."""
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=budgets(path)["minimum"])
    forced_logits(model, prompt())
    store = model.expert_store
    assert store.stats.loads > 4 * store.slots_per_layer * len(store.layers)


VARIANTS = {  # name -> (source, load options)
    "advisory": ("pack", {"routing": "advisory"}),
    "direct-io": ("pack", {"io": "direct"}),
    "in-place": ("mlx-lm", {}),
    "in-place-advisory": ("mlx-lm", {"routing": "advisory"}),
}


@pytest.mark.parametrize("budget", ["50%", "minimum"])
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("family", EXACT)
def test_reader_variants_are_exact(family, variant, budget, packs, checkpoints, reference):
    """Advisory prefetch, O_DIRECT, and an mlx-lm checkpoint read in place change
    where and when experts are read, never the output."""
    from edgemoe.format.source import open_source
    from edgemoe.mlx_backend.families import find_experts

    _, ref_tokens, ref_logits, ref_forced = reference(family)
    source, options = VARIANTS[variant]
    path = packs[family]["hf"] if source == "pack" else checkpoints[family][1]
    opened = open_source(path, find_experts=find_experts)  # a pack, or the checkpoint in place
    amount = {"50%": 0.5, "minimum": minimum_bytes(opened)}[budget]
    model, _ = edgemoe.load(path, expert_budget=amount, **options)
    tokens = prompt()
    assert mlx_lm_tokens(model, tokens) == ref_tokens
    assert mx.array_equal(greedy_logits(model, tokens), ref_logits).item()
    assert mx.array_equal(forced_logits(model, tokens), ref_forced).item()
    stats = model.expert_store.snapshot()
    assert stats.bytes_read > 0
    if options.get("routing") == "advisory":
        assert stats.predicted > 0 and stats.predicted_used > 0


@pytest.mark.parametrize("family,dtype", [("qwen3_moe_bf16", "bfloat16"),
                                          ("qwen3_moe_fp16", "float16")])
def test_half_precision_checkpoints_stream_half_precision_scales(family, dtype, packs):
    """The half families are what they say: their expert scales stay in half precision
    in the pack and in the slots (bf16 slots are uint16 storage viewed as bf16)."""
    from edgemoe.format.pack import Pack

    pack = Pack.open(packs[family]["hf"])
    assert {t.dtype for t in pack.layers[0].tensors} == {"uint32", dtype}
    model, _ = edgemoe.load(pack.path, expert_budget=0.5)
    pool = model.expert_store.pool(pack.layers[0].index)
    assert pool.arrays["gate_proj.scales"].dtype == getattr(mx, dtype)
