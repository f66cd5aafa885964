"""The decode hot path (issue #50): how many times a decoded token makes the host wait for
the device, per path, and that the paths that wait less stay bit-identical to mlx-lm.

Evaluations are counted as scripts/bench_hotpath.py counts them: every mx.eval and
mx.async_eval during decode (edgemoe's own host syncs go through edgemoe.mlx_backend.hostsync,
which calls mx.eval), with mlx-lm's own decode loop (one a token).
"""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.format.pack import Pack
from edgemoe.mlx_backend.hostsync import QueuedReads
from edgemoe.mlx_backend.slots import CallSlotIds, slot_ids_array
from edgemoe.streaming.budget import minimum_bytes
from edgemoe.streaming.slots import LayerSlots

from bench_hotpath import EvalCounter, decode, routing_sync
from unpack import unpack

BUNDLED = Path(edgemoe.__file__).resolve().parent / "models" / "fine"
LAYERS = 8  # the bundled model's MoE layers
TOKENS = 9  # decoded by each counted run: 8 counted (the first carries the prefill)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """mlx-lm's own model of the bundled pack, and a prompt."""
    model, tokenizer = mlx_lm_load(str(unpack(BUNDLED, tmp_path_factory.mktemp("fine"))))
    text = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    return model, mx.array(tokenizer.encode(text)[:32])


def wait_resident(store, timeout_s=120.0):
    """The reads of every whole layer (a slot per expert) have landed."""
    end = time.monotonic() + timeout_s
    while not all(store.pool(i).resident for i in store.layer_indices):
        assert time.monotonic() < end, "the layers never turned resident"
        time.sleep(0.01)


def evaluations_per_token(model, prompt) -> float:
    counter = EvalCounter()
    with counter.installed():
        return decode(model, prompt, TOKENS, counter)["evals_per_token"]


@pytest.mark.parametrize("routing", ["native", "advisory"])
def test_a_resident_model_decodes_with_mlx_lms_one_evaluation_a_token(reference, routing):
    """100%: every layer holds all its experts, so its slots are looked up on the device:
    no routing sync, one evaluation a token as mlx-lm, the same tokens, and the store
    still counts every request as a hit (advisory: nothing left to prefetch)."""
    ref, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="100%", routing=routing)
    store = model.expert_store
    counter = EvalCounter()
    with counter.installed():
        expected = decode(ref, prompt, TOKENS, counter)
        decode(model, prompt, TOKENS, counter)  # reads every layer whole
        wait_resident(store)
        before = store.snapshot()
        found = decode(model, prompt, TOKENS, counter)
    assert found["evals_per_token"] <= 2 and expected["evals_per_token"] == 1
    assert found["tokens"] == expected["tokens"]
    # each expert read into its own slot: a resident call is mlx-lm's own call, the
    # router's ids taken as slot ids, with no lookup added to the graph
    for i in store.layer_indices:
        slots = store.pool(i)
        assert slots.identity and list(slots.slot_of) == list(range(len(slots.slot_of)))
    stats = store.snapshot() - before
    assert stats.host_syncs == 0 and stats.bytes_read == 0
    # (the last call's counts settle with the next snapshot: its token is not read yet)
    assert stats.hits >= 8 * (TOKENS - 1) * LAYERS and stats.hit_rate == 1.0
    store.close()


def test_a_streamed_layer_waits_once_for_its_routing_and_never_for_its_experts(reference):
    """50%: one sync per MoE layer (its routing), none after the experts' compute."""
    _, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%")
    evaluations_per_token(model, prompt)  # warm
    assert evaluations_per_token(model, prompt) <= LAYERS + 1  # + the token's own
    model.expert_store.close()


def test_a_streamed_call_sends_its_slot_ids_and_gathers_none_from_the_table(
        reference, monkeypatch):
    """50%: a decode call's slot ids go to the device as an array the host wrote (its ids
    are on the host already), not as a gather from the live table in the graph, which
    costs the host more (docs/benchmarks.md, session 35), and each layer's decode calls
    rewrite one array, made once (session 36); its tokens are mlx-lm's."""
    ref, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%")
    counter = EvalCounter()
    with counter.installed():
        expected = decode(ref, prompt, TOKENS, counter)["tokens"]
        decode(model, prompt, TOKENS, counter)  # warm: the prefill's calls gather
        gathers, real_take = [], mx.take
        monkeypatch.setattr(mx, "take", lambda *a, **k: gathers.append(a) or real_take(*a, **k))
        sent, real_of = [], CallSlotIds.of
        monkeypatch.setattr(CallSlotIds, "of",
                            lambda self, *a: sent.append((self, real_of(self, *a))) or sent[-1][1])
        found = decode(model, prompt, TOKENS, counter)["tokens"]
    assert found == expected and gathers == []
    arrays = {}
    for pool, array in sent:
        arrays.setdefault(id(pool), set()).add(id(array))
    assert len(arrays) == LAYERS and all(len(a) == 1 for a in arrays.values())
    assert len(sent) >= LAYERS * (TOKENS - 1)  # (every decode call, on the plain path)
    model.expert_store.close()
    nested = slot_ids_array([3, 1, 2], (1, 1, 3))  # (a decode step's: no reshape)
    assert nested.dtype == mx.uint32 and nested.tolist() == [[[3, 1, 2]]]
    assert slot_ids_array(list(range(6)), (1, 2, 3)).tolist() == [[[0, 1, 2], [3, 4, 5]]]


def test_the_sync_floor_is_mlx_lms_own_model_reading_its_routing_back(reference):
    """bench_hotpath --sync-floor: mlx-lm's model with one routing read-back per MoE
    layer (its tokens unchanged), and as it was once the floor is lifted."""
    ref, prompt = reference
    counter = EvalCounter()
    with counter.installed():
        plain = decode(ref, prompt, TOKENS, counter)
        with routing_sync(True):
            synced = decode(ref, prompt, TOKENS, counter)
        after = decode(ref, prompt, TOKENS, counter)
    assert synced["tokens"] == plain["tokens"] == after["tokens"]
    assert (plain["evals_per_token"], synced["evals_per_token"], after["evals_per_token"]) \
        == (1, LAYERS + 1, 1)


def test_the_allocation_after_a_sync_is_timed_in_the_floor_and_in_edgemoe(reference):
    """bench_hotpath --sync-floor: a 2 KB allocation right after each routing sync, timed in
    mlx-lm's model with the floor and in a 50% model (a model with no sync has no row), and
    edgemoe's sync as it was afterwards."""
    from bench_hotpath import allocation_after_sync_us

    ref, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%")
    sync = QueuedReads.sync
    try:
        found = allocation_after_sync_us(
            {"mlx-lm": ref, "mlx-lm + routing sync": ref, "50%": model}, prompt, TOKENS,
            EvalCounter())
    finally:
        model.expert_store.close()
    assert sorted(found) == ["50%", "mlx-lm + routing sync"]
    assert all(us > 0 for us in found.values()) and QueuedReads.sync is sync


def test_decode_after_a_prompts_look_ahead_takes_the_plain_path(reference):
    """A prompt long enough for the look-ahead (edgemoe.streaming.prefill_ahead) leaves experts
    read ahead that no call requested (`prefetched`): the decode calls after it still take
    the plain path (`LayerSlots.claim`), not the general one, and decode mlx-lm's tokens."""
    ref, _ = reference
    # 48 tokens x top-8 entries, over twice the 128 experts: the prompt's calls look ahead, and
    # in some layers experts read ahead stay unrequested (in free slots: never evicted)
    prompt = mx.array(list(range(3, 51)))
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%")
    store, claim, refused = model.expert_store, LayerSlots.claim, []

    def counted(self, wanted):
        fills = claim(self, wanted)
        if fills is None:
            refused.append(self.layer.index)
        return fills

    try:
        models = (ref, model)  # (mlx-lm's first)
        caches = [make_prompt_cache(m) for m in models]
        logits = [m(prompt[None], cache=c)[:, -1] for m, c in zip(models, caches)]
        mx.eval(*logits)
        assert any(store.pool(i).prefetched for i in store.layer_indices)
        LayerSlots.claim = counted
        for _ in range(6):
            token = mx.argmax(logits[0], axis=-1)[None]
            assert mx.array_equal(token, mx.argmax(logits[1], axis=-1)[None])
            logits = [m(token, cache=c)[:, -1] for m, c in zip(models, caches)]
            mx.eval(*logits)
        assert refused == []
        assert mx.array_equal(logits[0], logits[1])
    finally:
        LayerSlots.claim = claim
        store.close()


@pytest.mark.parametrize("num_slots", [8, 64])
def test_the_minimal_streamer_decodes_mlx_lms_tokens_through_its_slots(reference, tmp_path,
                                                                       num_slots):
    """bench_hotpath --minimal: the yardstick streams every decode call through its slots
    (8: top-k, every call evicts; 64: half the experts) and decodes mlx-lm's tokens."""
    from minimal_streamer import install

    ref, prompt = reference
    model, _ = mlx_lm_load(str(unpack(BUNDLED, tmp_path)))
    streamers = install(model, num_slots)
    counter = EvalCounter()
    with counter.installed():
        expected = decode(ref, prompt, TOKENS, counter)["tokens"]
        got = decode(model, prompt, TOKENS, counter)["tokens"]
    assert got == expected
    assert len(streamers) == LAYERS
    for s in streamers:
        assert s.calls >= TOKENS - 1 and s.misses >= 8  # (its first decode call misses all)
        assert len(s.slot_of) <= num_slots
        assert sorted(s.slot_of.values()) == sorted(set(s.slot_of.values()))


def test_prerouted_decode_evaluates_twice_a_token(reference, tmp_path):
    """Prerouted: the routing of every predicted layer is on the host a token ahead, and
    the predictions are evaluated with the next token's first routing sync (the pack's
    heads routing every layer but the first: the shipped default keeps more native)."""
    from edgemoe.routing.between import plain_heads

    _, prompt = reference
    heads = plain_heads(BUNDLED / "prerouter", tmp_path / "heads")
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%", routing="prerouted",
                            prerouter_path=str(heads))
    evaluations_per_token(model, prompt)
    assert evaluations_per_token(model, prompt) <= 2
    model.expert_store.close()


def forced_logits(model, prompt, cache=None):
    cache = cache or make_prompt_cache(model)
    return mx.concatenate([model(t.reshape(1, 1), cache=cache)[0] for t in prompt])


@pytest.mark.parametrize("budget,routing", [("100%", "native"), ("100%", "advisory"),
                                            ("minimum", "native"), ("minimum", "advisory")])
def test_the_new_paths_give_mlx_lms_logits_bit_for_bit(reference, budget, routing):
    """The resident table (100%) and the held slots (minimum budget: a refill at nearly
    every call) give mlx-lm's logits, token after token."""
    ref, prompt = reference
    expected = forced_logits(ref, prompt)
    amount = minimum_bytes(Pack.open(BUNDLED)) if budget == "minimum" else budget
    model, _ = edgemoe.load(BUNDLED, expert_budget=amount, routing=routing)
    store = model.expert_store
    if budget == "100%":
        forced_logits(model, prompt[:2])
        wait_resident(store)
    before = store.snapshot()
    assert mx.array_equal(forced_logits(model, prompt), expected).item()
    stats = store.snapshot() - before
    assert (stats.host_syncs == 0) == (budget == "100%")
    assert (stats.evictions > 0) == (budget == "minimum")
    store.close()


def interleaved(model, prompt):
    """Sequence A's step is built and left unevaluated while sequence B's steps refill
    the slots; then A is evaluated."""
    a_cache, b_cache = make_prompt_cache(model), make_prompt_cache(model)
    out = []
    for t, u in zip(prompt[: len(prompt) // 2], prompt[len(prompt) // 2:][::-1]):
        a = model(t.reshape(1, 1), cache=a_cache)[0]  # lazy
        mx.eval(model(u.reshape(1, 1), cache=b_cache))  # B's reads fill slots
        out.append(a)
    return mx.concatenate(out)


def test_a_slot_a_queued_computation_reads_is_never_refilled(reference, monkeypatch):
    """GUIDE: never refill a slot that a queued computation still reads. A's compute is
    left queued while B's calls need slots: they either find others or first evaluate
    A's (QueuedReads). Releasing A's slots as soon as its graph is built (what holding
    them prevents) is caught: B's reads overwrite what A's queued compute reads."""
    ref, prompt = reference
    expected = mx.concatenate([forced_logits(ref, prompt[: len(prompt) // 2])])
    amount = minimum_bytes(Pack.open(BUNDLED))
    model, _ = edgemoe.load(BUNDLED, expert_budget=amount)
    assert mx.array_equal(interleaved(model, prompt), expected).item()
    model.expert_store.close()

    monkeypatch.setattr(QueuedReads, "hold", lambda self, pool, output: pool.release())
    model, _ = edgemoe.load(BUNDLED, expert_budget=amount)
    assert not mx.array_equal(interleaved(model, prompt), expected).item()
    model.expert_store.close()


def test_a_resident_layers_hits_are_counted_whether_or_not_its_tallies_were_compacted(
        reference, monkeypatch):
    """A resident call's requests are counted on the device, many calls at a time: the
    store's hits are the same however many calls are counted together."""
    from edgemoe.mlx_backend import hostsync

    _, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="100%")
    store = model.expert_store
    counter = EvalCounter()
    with counter.installed():
        decode(model, prompt, TOKENS, counter)
        wait_resident(store)
        hits = []
        for batch in (hostsync.TALLY_BATCH, 3):
            monkeypatch.setattr(hostsync, "TALLY_BATCH", batch)
            model.streaming.queued.settle_tallies(everything=True)
            before = store.snapshot()
            decode(model, prompt, TOKENS, counter)
            model.streaming.queued.settle_tallies(everything=True)
            hits.append((store.snapshot() - before).hits)
    assert hits[0] == hits[1] > 8 * TOKENS * LAYERS
    store.close()


def test_hits_first_gives_mlx_lms_logits_with_one_evaluation_started_per_missing_layer(
        reference, monkeypatch):
    """Hits first (#50 item 3; off by default): at the minimum budget (misses at nearly every
    call) a call's hits are started while its misses are read, then the misses; the rows
    go back in mlx-lm's order, so the logits are mlx-lm's, and a layer that misses adds
    one evaluation started (`async_eval`), never a wait."""
    from edgemoe.mlx_backend import experts

    monkeypatch.setattr(experts, "HITS_FIRST", True)
    ref, prompt = reference
    expected = forced_logits(ref, prompt[:16])
    model, _ = edgemoe.load(BUNDLED, expert_budget=minimum_bytes(Pack.open(BUNDLED)))
    counter = EvalCounter()
    with counter.installed():
        found = forced_logits(model, prompt[:16])
        mx.eval(found)
    assert mx.array_equal(found, expected).item()
    per_token = counter.count / 16
    assert LAYERS + 1 < per_token <= 2 * LAYERS + 1  # (the hits of most layers started)
    model.expert_store.close()


def test_a_resident_prompt_chunk_leaves_no_attention_for_the_next_snapshot(reference):
    """After a prompt chunk mlx-lm evaluates only the KV cache, so the last layer's routing
    is in no graph it evaluates. A resident call's tally of it must not keep that layer's
    attention for the store's next snapshot to compute (a 32K prompt peaked at 16.9 GB so,
    every chunk's scores at once): settling then allocates next to nothing."""
    _, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="100%")
    store = model.expert_store
    for _ in range(3):  # reads every layer whole
        mx.eval(model(prompt[None]))
    wait_resident(store)
    chunk = mx.concatenate([prompt] * 32)[None]  # 1,024 tokens
    cache = make_prompt_cache(model)
    for _ in range(2):  # as mlx-lm prefills
        model(chunk, cache=cache)
        mx.eval([c.state for c in cache])
    mx.synchronize()
    mx.reset_peak_memory()
    active = mx.get_active_memory()
    store.snapshot()
    heads = model.args.num_attention_heads
    scores = heads * chunk.shape[1] * 2 * chunk.shape[1] * 4  # one layer's, float32
    assert mx.get_peak_memory() - active < scores / 4
    store.close()


def test_the_parts_timers_time_each_part_and_leave_the_code_as_it_was(reference):
    """scripts/hotpath_parts.py: every part it names is timed in a decode at 50%, and
    each claim, as all hits or with misses (both kinds occur there); the tokens are
    unchanged, and the code is as it was once the timers are removed."""
    import collections

    from hotpath_parts import claims_timed, parts_of, timers

    ref, prompt = reference
    model, _ = edgemoe.load(BUNDLED, expert_budget="50%")
    try:
        parts, spent, counter = parts_of(ref), collections.Counter(), EvalCounter()
        before = {name: getattr(owner, attr) for name, (owner, attr) in parts.items()}
        claim, claims = LayerSlots.claim, {"all hits": [], "with misses": []}
        plain = decode(model, prompt, TOKENS, counter)
        with timers(parts, spent), claims_timed(claims):
            timed = decode(model, prompt, TOKENS, counter)
        assert timed["tokens"] == plain["tokens"]
        assert {name: getattr(owner, attr) for name, (owner, attr) in parts.items()} == before
        assert [name for name in parts if spent[name] <= 0] == []
        assert LayerSlots.claim is claim and all(t and min(t) > 0 for t in claims.values())
    finally:
        model.expert_store.close()


def test_the_host_only_bench_times_the_claim_after_each_kind_of_time_away():
    """`bench_hotpath --host-only`: the host's side of the shipped trace's calls, and an
    all-hit claim and release after each of its five kinds of time away, all timed."""
    import argparse

    from bench_hotpath import host_path

    args = argparse.Namespace(model=BUNDLED, budgets=["25%"], host_tokens=64)
    result = host_path(args)
    (row,) = result["rows"]
    assert row["loads"] > 0 and row["hits"] > 0 and row["us_per_call"] > 0
    after = result["all_hit_call_after_evaluation_us"]
    assert list(after) == ["none", "sleep", "loop", "trivial", "graph"]
    assert all(us > 0 for us in after.values())


def test_the_benchs_interval_of_a_median_is_the_medians_not_the_rounds_spread():
    """`median_interval`: a bootstrap interval of the paired rounds' median. It holds the
    median, it is narrower than the rounds' quartiles and narrows as rounds are added,
    and it is the same for the same rounds (a fixed seed: a rerun prints the same)."""
    import random

    from bench_hotpath import median_interval, quartiles

    draw = random.Random(7)
    rounds = [draw.gauss(100, 80) for _ in range(160)]
    few, many = median_interval(rounds[:20]), median_interval(rounds)
    q = quartiles(rounds)
    assert many[0] <= statistics.median(rounds) <= many[1]
    assert q[0] < many[0] and many[1] < q[1]
    assert many[1] - many[0] < few[1] - few[0]
    assert median_interval(rounds) == many and median_interval([3.0]) == [3.0, 3.0]


def test_the_instruction_count_reads_each_threads_total_and_names_a_missing_valgrind(
        tmp_path):
    """scripts/hotpath_instructions.py: a run's threads in numeric order (the decoding thread
    first), the process it runs under callgrind decodes as bench_hotpath does, and without
    valgrind it says so in one line."""
    import hotpath_instructions

    for thread, count in ((1, 100), (2, 7), (10, 3)):
        (tmp_path / f"callgrind.50.8-{thread:02d}").write_text(
            f"# callgrind format\nevents: Ir\nsummary: {count}\n")
    assert hotpath_instructions.thread_counts(tmp_path / "callgrind.50.8") == [100, 7, 3]
    script = Path(hotpath_instructions.__file__)
    child = subprocess.run([sys.executable, str(script), "--child", "50%", "3", "--prompt", "8"],
                           capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr
    bare = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "PATH": str(tmp_path)}, timeout=60)
    assert bare.returncode == 1 and bare.stderr.strip().splitlines() == [
        "hotpath_instructions: needs valgrind (apt install valgrind), not found on PATH"]
