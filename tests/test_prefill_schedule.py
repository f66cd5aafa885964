"""Prefill by expert (issue #55, item 4): a prompt chunk reads each expert it needs once,
also when it needs more experts than the layer has slots and when a layer's first pass
is read ahead of its routing (edgemoe.streaming.prefill_ahead), and its logits stay mlx-lm's;
the explicit BLAS arithmetic (edgemoe.mlx_backend.prefill) stays within its stated tolerance.

Reads are counted where the slot state machine claims a slot for a read
(`LayerSlots._start_fill`), per (layer, expert), chunk by chunk.
"""

from collections import Counter
from pathlib import Path
from unittest.mock import patch

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
import edgemoe.mlx_backend.prefill as prefill_module
from edgemoe.mlx_backend.experts import StreamingExperts
from edgemoe.mlx_backend.prefill import LOGIT_TOLERANCE, BlasExperts, BlasLinear
from edgemoe.streaming import calls, prefill_ahead
from edgemoe.streaming.calls import run_call
from edgemoe.streaming.prefill_ahead import look_ahead
from edgemoe.whatif.replay import replay_pack, replay_store

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
    per_chunk, stats = [], [store.snapshot()]

    def between():
        per_chunk.append(counter.take())
        stats.append(store.snapshot())
    found = prefill(model, prompt, between)
    assert per_chunk[0], "the first chunk streamed its experts"
    for reads in per_chunk:
        assert max(reads.values(), default=1) == 1, [k for k, n in reads.items() if n > 1]
    if budget == "25%":  # the chunks needed more experts than slots: passes ran
        assert len(per_chunk[0]) > store.slots_per_layer * len(store.layers)
        assert store.snapshot().evictions > 0
        # the cold chunk read each layer's first pass ahead of its routing (48 x top-8
        # entries, 3x the experts: edgemoe.streaming.prefill_ahead), among the reads
        # counted once above, and its calls computed most of them (89 of 128: at 3 entries
        # an expert, a cold guess by id misses some); the next chunk found its pools full
        # and read nothing ahead
        first, second = stats[1] - stats[0], stats[2] - stats[1]
        assert first.prefetches == len(store.layers) * store.slots_per_layer // 2
        assert sum(per_chunk[0].values()) == first.loads
        assert first.predicted == first.prefetches
        assert first.predicted_used > first.prefetches / 2
        assert second.prefetches == 0
    for got, want in zip(found, expected):
        assert mx.array_equal(got, want).item()


def test_the_look_ahead_reads_a_first_pass_into_free_slots_only():
    """A long call's first pass is read before its routing (into free slots, never
    evicting), the call computes it first, and every expert is still read once."""
    pack = replay_pack([4096], [32], 4)
    store = replay_store(pack, 8, "lfu")  # passes of 4
    pool = store.pool(0)
    counter = ReadCounter(store)
    ids = np.arange(64).reshape(16, 4) % 32  # 64 entries, every expert twice
    assert look_ahead(pool, ids.size - 1) == 0  # under AHEAD_FACTOR x the experts
    assert look_ahead(pool, ids.size) == 4
    assert sorted(pool.expert_in[pool.expert_in >= 0].tolist()) == [0, 1, 2, 3]
    assert look_ahead(pool, ids.size) == 0  # a pass is in slots already
    first = []
    run_call(pool, ids, lambda rows, slot_ids: first.append(set(pool.expert_in[slot_ids])))
    assert first[0] == {0, 1, 2, 3} and len(first) == 8
    assert max(counter.take().values()) == 1
    stats = store.snapshot()
    assert (stats.prefetches, stats.predicted, stats.predicted_used) == (4, 4, 4)
    # a full pool (its experts go first anyway) reads nothing ahead; nor does a pool
    # with a slot for every expert, nor the path before it
    assert look_ahead(pool, ids.size) == 0
    whole = replay_store(pack, 32, "lfu").pool(0)
    assert look_ahead(whole, ids.size) == 0
    fresh = replay_store(pack, 8, "lfu").pool(0)
    with patch.object(prefill_ahead, "LOOK_AHEAD", False):
        assert look_ahead(fresh, ids.size) == 0
    # the most used experts first (LFU), where the pool has seen calls
    for e in (30, 30, 7):
        fresh.policy.touch(e)
    assert look_ahead(fresh, ids.size) == 4
    assert sorted(fresh.expert_in[fresh.expert_in >= 0].tolist()) == [0, 1, 7, 30]



def test_a_long_calls_host_shortcuts_change_no_schedule():
    """A long call's experts found by a count (`run_call` above COUNT_ABOVE entries) make
    the passes that a set makes, and the look-ahead's reads into free slots found once are
    the fills that `prefetch` starts: the same slots, experts and counts."""
    pack = replay_pack([4096], [128], 8)
    ids = np.random.default_rng(0).integers(0, 128, (1, 4096, 8))
    assert ids.size > calls.COUNT_ABOVE

    def warm(pool):  # some slots ready, the rest free; the policy has seen calls
        run_call(pool, np.array([[[3, 9, 40, 41, 77, 100, 101, 127]]]), lambda *a: None)
        for e in (5, 5, 6, 120):
            pool.policy.touch(e)

    def schedule(count_above):
        store = replay_store(pack, 32, "lfu")
        pool = store.pool(0)
        warm(pool)
        passes = []
        with patch.object(calls, "COUNT_ABOVE", count_above):
            assert look_ahead(pool, ids.size) == 8  # a pass of 16, 8 of them in slots
            run_call(pool, ids, lambda rows, slot_ids: passes.append(
                (rows.tolist(), pool.expert_in[slot_ids].tolist())))
        s = store.snapshot()
        return passes, (s.loads, s.hits, s.prefetches, s.predicted, s.predicted_used)

    by_count, by_set = schedule(calls.COUNT_ABOVE), schedule(10 ** 9)
    assert len(by_count[0]) == 8 and by_count == by_set
    # the look-ahead's fills, beside prefetch's of the same experts
    ahead, asked = replay_store(pack, 32, "lfu").pool(0), replay_store(pack, 32, "lfu").pool(0)
    warm(ahead)
    warm(asked)
    look_ahead(ahead, ids.size)
    chosen = np.array(sorted(set(ahead.pending_prediction)))
    assert len(chosen) == 8 and {5, 6, 120} <= set(chosen.tolist())  # the hottest first
    asked.prefetch(chosen, lead=0)
    for name in ("slot_of", "expert_in", "state"):
        assert (getattr(ahead, name) == getattr(asked, name)).all(), name
    assert (ahead.prefetched, ahead.pending_prediction) == (asked.prefetched,
                                                            asked.pending_prediction)
    assert ahead.stats.prefetches == asked.stats.prefetches == 8


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
