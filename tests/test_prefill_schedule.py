"""Prefill by expert (issue #55, item 4): a prompt chunk reads each expert it needs once,
also when it needs more experts than the layer has slots, and its logits stay mlx-lm's;
the explicit BLAS arithmetic (edgemoe.model.prefill) stays within its stated tolerance.

Reads are counted where the slot state machine claims a slot for a read
(`LayerSlots._start_fill`), per (layer, expert), chunk by chunk.
"""

from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
import edgemoe.model.prefill as prefill_module
from edgemoe.model.experts import StreamingExperts
from edgemoe.model.prefill import LOGIT_TOLERANCE, BlasExperts, BlasLinear

from unpack import unpack

BUNDLED = Path(edgemoe.__file__).resolve().parent / "models" / "fine"
CHUNK, CHUNKS = 48, 2  # 48 tokens x top-8: most of a layer's 128 experts, 3x a 25% pool


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """mlx-lm's own model of the bundled pack, a prompt, and mlx-lm's logits chunk by chunk."""
    model, tokenizer = mlx_lm_load(str(unpack(BUNDLED, tmp_path_factory.mktemp("fine"))))
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    prompt = mx.array(tokenizer.encode(text)[:CHUNK * CHUNKS])
    return prompt, prefill(model, prompt), model


def prefill(model, prompt, between=lambda: None):
    """The prompt's logits, a chunk per forward call as mlx-lm's prefill steps it;
    `between()` after each chunk."""
    cache = make_prompt_cache(model)
    out = []
    for start in range(0, prompt.size, CHUNK):
        out.append(model(prompt[None, start:start + CHUNK], cache=cache)[0])
        mx.eval(out[-1])
        between()
    return out


class ReadCounter:
    """Every read the store's slots start, by (layer, expert), since the last `take()`."""

    def __init__(self, store):
        self.reads = Counter()
        for pool in store.layers.values():
            start = pool._start_fill

            def counted(expert, *args, _start=start, _layer=pool.layer.index, **kwargs):
                self.reads[_layer, expert] += 1
                return _start(expert, *args, **kwargs)
            pool._start_fill = counted

    def take(self) -> Counter:
        reads, self.reads = self.reads, Counter()
        return reads


@pytest.mark.parametrize("budget", ["25%", "100%"])
def test_a_prefill_chunk_reads_each_expert_once_and_keeps_mlx_lms_logits(reference, budget):
    prompt, expected, _ = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget=budget)
    store = model.expert_store
    counter = ReadCounter(store)
    per_chunk = []
    found = prefill(model, prompt, lambda: per_chunk.append(counter.take()))
    assert per_chunk[0], "the first chunk streamed its experts"
    for reads in per_chunk:
        assert max(reads.values(), default=1) == 1, [k for k, n in reads.items() if n > 1]
    if budget == "25%":  # the chunks needed more experts than slots: passes ran
        assert len(per_chunk[0]) > store.slots_per_layer * len(store.layers)
        assert store.snapshot().evictions > 0
    for got, want in zip(found, expected):
        assert mx.array_equal(got, want).item()



def test_blas_prefill_is_within_its_stated_tolerance_of_mlx_lm(reference, monkeypatch):
    """The explicit, inexact option: every chunk's logits within LOGIT_TOLERANCE of
    mlx-lm's and the same greedy token at every position, the experts, linears and
    attention computed by BLAS (25%: the passes of a chunk that needs more experts than
    slots); mlx-lm's own model of the same family, in the same process, is untouched."""
    prompt, expected, mlx_lm_model = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="25%", prefill_arithmetic="blas")
    pools = [m.pool.module for _, m in model.named_modules() if isinstance(m, StreamingExperts)]
    assert len(pools) == 8 and all(isinstance(m, BlasExperts) for m in pools)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, BlasLinear) and isinstance(model.lm_head, BlasLinear)
    assert not isinstance(layer.mlp.gate, BlasLinear)  # (a router's choices stay mlx-lm's)
    products = Counter()
    compute = prefill_module.expert_products

    def counted(*args):
        products["calls"] += 1
        return compute(*args)
    dense = BlasLinear.__call__

    def dense_counted(self, x):
        products["dense"] += x.size // x.shape[-1] >= prefill_module.MIN_DENSE_ROWS
        return dense(self, x)
    monkeypatch.setattr(BlasLinear, "__call__", dense_counted)
    attention = prefill_module.blas_attention

    def attention_counted(*args):
        products["attention"] += 1
        return attention(*args)
    monkeypatch.setattr(prefill_module, "blas_attention", attention_counted)
    monkeypatch.setattr(prefill_module, "expert_products", counted)
    # (every call of a few rows per expert too: the threshold is about speed, the
    # tolerance about every call BLAS computes)
    monkeypatch.setattr(prefill_module, "MIN_ROWS_PER_EXPERT", 1)
    found = prefill(model, prompt)
    assert products["calls"] >= len(pools) * CHUNKS and products["dense"] >= 33 * CHUNKS
    assert products["attention"] == 8 * CHUNKS
    worst = max(mx.abs(got - want).max().item() for got, want in zip(found, expected))
    assert worst <= LOGIT_TOLERANCE
    for got, want in zip(found, expected):
        assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    again = prefill(mlx_lm_model, prompt)
    assert products["attention"] == 8 * CHUNKS
    assert all(mx.array_equal(a, b).item() for a, b in zip(again, expected))
