"""The streaming core: the call protocol survives errors, routing state belongs to the
sequence, and the trace replay runs the store's own state machine."""

import contextlib
import os
import signal
import threading
import time

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import edgemoe
from edgemoe.format.pack import PackError
from edgemoe.format.source import open_source
from edgemoe.mlx_backend.experts import StreamingExperts
from edgemoe.mlx_backend.slots import MLXSlotMemory
from edgemoe.streaming.budget import minimum_bytes
from edgemoe.whatif.replay import simulate

TOKENS = mx.array(np.random.default_rng(4).integers(3, 500, (1, 9)))
OTHER = mx.array(np.random.default_rng(5).integers(3, 500, (1, 9)))  # other experts


@contextlib.contextmanager
def deadline(seconds: float):
    """Fail, instead of hanging, when the block takes longer than `seconds`."""
    def expired(*_):
        raise TimeoutError(f"still running after {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def experts_of(model):
    return [m for _, m in model.named_modules() if isinstance(m, StreamingExperts)]


@pytest.fixture
def small(packs):
    """A pack at its minimum budget (every call loads), and its correct logits on OTHER."""
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=minimum_bytes(open_source(path)))
    expected = model(OTHER)
    mx.eval(expected)
    return model, expected


def test_an_exception_in_compute_leaves_the_store_usable(small):
    model, expected = small
    module = experts_of(model)[2]
    pool = module.pool.module

    def broken(*args):
        raise RuntimeError("injected compute failure")

    module.pool.module = broken
    with pytest.raises(RuntimeError, match="injected compute failure"):
        model(TOKENS)
    assert module.slots.in_use == []  # released although compute failed
    module.pool.module = pool
    with deadline(1.0):  # the failed call's slots must be free for other experts
        again = model(OTHER)
        mx.eval(again)
    assert mx.array_equal(again, expected)


def test_an_exception_in_a_held_call_releases_its_slots_at_once(small):
    """A call asked to keep its slots in use past its return (the one-sync decode path,
    edgemoe.mlx_backend.hostsync) keeps none when its compute fails."""
    from edgemoe.streaming.calls import run_call

    model, _ = small
    slots = experts_of(model)[2].slots

    def broken(*args):
        raise RuntimeError("injected compute failure")

    with pytest.raises(RuntimeError, match="injected compute failure"):
        run_call(slots, np.array([[0, 1]]), broken, hold=True)
    assert slots.in_use == []


def test_a_read_error_leaves_the_store_usable(small):
    model, expected = small
    reader = model.expert_store.reader
    read = reader._read_buffered
    failures = []

    def fail_once(run):
        if not failures:
            failures.append(run)
            raise OSError(5, "Input/output error")
        return read(run)

    reader._read_buffered = fail_once
    with pytest.raises(PackError, match=r"layer \d+ expert \d+: read failed"):
        model(TOKENS)
    for module in experts_of(model):
        assert module.slots.in_use == []
    with deadline(1.0):  # the failed call's slots must be free for other experts
        again = model(OTHER)
        mx.eval(again)
    assert failures and mx.array_equal(again, expected)


def test_slots_never_released_are_an_error_not_a_hang(packs):
    from edgemoe.streaming.store import ExpertStore

    pack = open_source(packs["qwen3_moe"]["hf"])
    store = ExpertStore(pack, minimum_bytes(pack), memory=MLXSlotMemory)  # top-k = 2 slots a layer
    pool = store.pool(pack.layers[0].index)
    pool.ensure(np.array([0, 1]))  # in use, and never released (a caller's bug)
    with deadline(1.0), pytest.raises(RuntimeError, match="never released"):
        pool.ensure(np.array([2, 3]))
    store.close()


def greedy_tokens(model, prompt, n=12):
    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n,
                                              sampler=make_sampler(0.0))]


def plain_prerouted(tmp_path):
    """The bundled model routed by the pack's heads at every layer but the first (the
    shipped default's cache-conditional layers route among slots that all sequences
    share, as the store's are: docs/routing.md)."""
    from edgemoe.format.source import BUNDLED_MODEL
    from edgemoe.routing.between import plain_heads

    heads = plain_heads(BUNDLED_MODEL / "prerouter", tmp_path / "heads")
    return edgemoe.load(expert_budget=0.25, routing="prerouted", prerouter_path=str(heads))[0]


def test_interleaved_sequences_keep_their_own_routing(tmp_path):
    """Two sequences decoded step by step in turn give each one's tokens alone: the
    prerouter state of one never reaches the other."""
    model = plain_prerouted(tmp_path)
    a = mx.array(np.random.default_rng(1).integers(3, 4000, 11))
    b = mx.array(np.random.default_rng(2).integers(3, 4000, 5))
    alone = [greedy_tokens(model, a), greedy_tokens(model, b)]
    steps = [generate_step(p, model, max_tokens=12, sampler=make_sampler(0.0)) for p in (a, b)]
    together = [[], []]
    for _ in range(12):
        for i, gen in enumerate(steps):
            together[i].append(int(next(gen)[0]))
    assert together == alone
    assert alone[0] != greedy_tokens(edgemoe.load(expert_budget=0.25)[0], a)  # routing changed


def test_a_new_request_does_not_see_the_last_ones_prediction(tmp_path):
    model = plain_prerouted(tmp_path)
    prompt = mx.array(np.random.default_rng(3).integers(3, 4000, 7))
    first = model(prompt[None], cache=make_prompt_cache(model))
    model(mx.array([[5, 6, 7]]), cache=make_prompt_cache(model))  # another sequence
    assert mx.array_equal(model(prompt[None], cache=make_prompt_cache(model)), first)


class WaitingReader:
    """The real reader, but `submit` returns once the fills are done: the store's
    timing then cannot change its decisions, so a replay must match it exactly."""

    def __init__(self, reader):
        self.reader = reader

    def submit(self, fills):
        self.reader.submit(fills)
        for f in fills:  # (a pool's fills carry no Event: they end by `ended`)
            while not f.ended:
                time.sleep(0.0005)

    def __getattr__(self, name):
        return getattr(self.reader, name)


@pytest.mark.parametrize("policy", ["lfu"])
def test_prefetch_replay_matches_the_store_in_advisory_mode(packs, policy):
    path = packs["qwen3_moe_large"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=0.25, routing="advisory", cache_policy=policy)
    store = model.expert_store
    waiting = WaitingReader(store.reader)
    for index in store.layer_indices:
        store.pool(index).reader = waiting
    trace = store.start_trace()
    prompt = mx.array(np.random.default_rng(0).integers(3, 500, 24))
    for _ in generate_step(prompt, model, max_tokens=16, sampler=make_sampler(0.0)):
        pass
    stats = store.snapshot()
    replayed = simulate(trace.as_trace(), 0.25, policy, prefetch=True)
    assert stats.prefetches > 0 and stats.late_fills == 0
    assert (replayed.hits, replayed.on_demand, replayed.loads, replayed.prefetches,
            replayed.evictions, replayed.bytes_read) == (
        stats.hits, stats.on_demand, stats.loads, stats.prefetches, stats.evictions,
        stats.bytes_read)
    plain = simulate(trace.as_trace(), 0.25, policy)  # the same routing, no prefetches
    assert plain.prefetches == 0 and plain.loads == plain.on_demand


def test_a_stuck_read_fails_the_call_and_marks_the_store_unhealthy(packs, monkeypatch):
    from edgemoe.streaming import reads as reads_module

    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=minimum_bytes(open_source(path)),
                            read_timeout=0.3)
    expected = model(OTHER)
    mx.eval(expected)
    store, unstuck, preadv = model.expert_store, threading.Event(), os.preadv

    def stuck_preadv(*args):
        unstuck.wait(30)
        return preadv(*args)

    monkeypatch.setattr(reads_module.os, "preadv", stuck_preadv)
    with deadline(5.0), pytest.raises(PackError, match=r"did not finish within 0.3 s "
                                                         r"\(--read-timeout\)"):
        model(TOKENS)
    # The call's wait may begin before the reader reaches `preadv` (a loaded machine starts
    # it late): the read itself passes the timeout soon after, and from then on it shows.
    with deadline(5.0):
        while store.healthy():
            time.sleep(0.01)
    monkeypatch.setattr(reads_module.os, "preadv", preadv)
    unstuck.set()
    with deadline(5.0):
        again = model(OTHER)
        mx.eval(again)
    assert mx.array_equal(again, expected) and store.healthy()


class HeldReader:
    """The real reader, but the first fills submitted wait in a list until `release()`."""

    def __init__(self, reader):
        self.reader, self.held = reader, None

    def submit(self, fills):
        if self.held is None:
            self.held = list(fills)
        else:
            self.reader.submit(fills)

    def release(self):
        self.reader.submit(self.held)

    def __getattr__(self, name):
        return getattr(self.reader, name)


def test_a_stale_prefetch_is_dropped_unread_and_its_slot_freed(packs):
    """A prefetch for a call that then does not request its expert, still queued when the
    call starts, is cancelled: never read, its slot free again; a prefetch the call does
    request is kept (a late fill)."""
    import time

    from edgemoe.streaming.fills import FILLING

    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=0.5)
    store = model.expert_store
    pool = store.pool(store.layer_indices[1])
    held = pool.reader = HeldReader(pool.reader)
    free = [e for e in range(pool.layer.num_experts) if pool.slot_of[e] < 0]
    stale, kept, needed = free[:3]
    before = store.snapshot()
    pool.prefetch(np.array([stale, kept]))  # native: the pool is ungated
    threading.Timer(0.2, held.release).start()  # `kept` lands while the call waits for it
    pool.ensure(np.array([kept, needed]))
    pool.release()
    deadline = time.monotonic() + 5  # the reader ends the stale fill (unread) by itself
    while np.any(pool.state == FILLING) and time.monotonic() < deadline:
        time.sleep(0.01)
    delta = store.snapshot() - before
    assert delta.prefetch_cancelled == 1 and delta.prefetches == 2 and delta.late_fills == 1
    assert delta.bytes_read == 2 * pool.layer.expert_bytes  # kept and needed, not stale
    assert pool.slot_of[stale] < 0 and stale not in pool.fills
    assert not np.any(pool.state == FILLING)  # the stale one's slot is free again
    store.close()


def test_a_whole_layer_turns_resident_when_a_cancelled_fill_gives_back_its_slot(packs):
    """With a slot for every expert, a call's end reads the rest of the layer. A cancelled
    prefetch still holds its slot until the reader ends it, so the last expert finds no
    room then; it is read once that slot is free, not at the layer's next call (which
    may never come)."""
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget="100%")
    store = model.expert_store
    pool = store.pool(store.layer_indices[1])
    held = pool.reader = HeldReader(pool.reader)
    stale, needed = 0, 1
    pool.prefetch(np.array([stale]))  # held: not begun, so the call cancels it
    pool.ensure(np.array([needed]))
    pool.release()  # reads the rest of the layer but one: the stale fill's slot is taken
    assert not pool.resident and len(pool.cancelled) == 1
    held.release()  # the reader ends the cancelled fill, unread
    deadline = time.monotonic() + 10
    while not pool.resident:
        assert time.monotonic() < deadline, "the layer never turned resident"
        time.sleep(0.01)
    assert (pool.slot_of >= 0).all() and not pool.cancelled
    store.close()
