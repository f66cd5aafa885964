"""Expert cache policies, the trace replay, and Belady's optimum."""

import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step

import edgemoe
from edgemoe.streaming import cache
from edgemoe.streaming.cache import POLICIES, make_policy
from edgemoe.whatif.experimental import learned as learned_module
from edgemoe.whatif.experimental.fit_learned import train_learned
from edgemoe.whatif.experimental.learned import LearnedPolicy, NextUseModel
from edgemoe.whatif.replay import (BeladyPolicy, Requests, forward_calls, layer_requests,
                                      replay, run, simulate)
from edgemoe.format.pack import Pack
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402


def requests(*steps):
    steps = [np.array(sorted(s)) for s in steps]
    return Requests(steps, np.ones(len(steps), dtype=bool))


def hits_loads(reqs, slots, policy):
    return tuple(int(n) for n in replay(reqs, slots, policy).sum(0))


def test_belady_single_expert_steps():
    # 2 slots, requests 0 1 2 0 1 3 0 1. Belady: load 0, load 1; 2 evicts 1 (next use
    # step 4, later than 0's step 3); 0 hits; 1 evicts 2 (never used again); 3 evicts 1
    # (next at 7, after 0's 6); 0 hits; 1 evicts 3 or 0: 2 hits, 6 loads.
    reqs = requests(*[[e] for e in (0, 1, 2, 0, 1, 3, 0, 1)])
    assert hits_loads(reqs, 2, BeladyPolicy(reqs.steps)) == (2, 6)


def test_belady_with_pinned_pairs():
    # 4 slots, top-2, three pairs in a cycle: {0,1} {2,3} {4,5} {0,1} {2,3} {4,5}.
    # Belady: {4,5} evicts 2, 3 (next used after 0, 1); {0,1} hits both; {2,3} evicts
    # 0, 1 (never used again); {4,5} hits both: 4 hits, 8 loads (6 are unavoidable, and
    # {2,3} cannot be kept beside {0,1} and {4,5}).
    reqs = requests([0, 1], [2, 3], [4, 5], [0, 1], [2, 3], [4, 5])
    assert hits_loads(reqs, 4, BeladyPolicy(reqs.steps)) == (4, 8)


def optimal_loads(reqs: Requests, slots: int) -> int:
    """Fewest loads over every eviction choice (exhaustive search over resident sets)."""
    best = {frozenset(): 0}
    for step in reqs.steps:
        need = set(step.tolist())
        nxt = {}
        for resident, loads in best.items():
            loads += len(need - resident)
            keep = resident | need
            for evict in itertools.combinations(sorted(resident - need),
                                                max(len(keep) - slots, 0)):
                state = frozenset(keep - set(evict))
                nxt[state] = min(nxt.get(state, 1 << 30), loads)
        best = nxt
    return min(best.values())


def random_requests(rng, n_experts, k, n_steps):
    return requests(*[rng.choice(n_experts, k, replace=False) for _ in range(n_steps)])


def test_belady_is_optimal_on_random_traces():
    rng = np.random.default_rng(0)
    for trial in range(30):
        n_experts, k = int(rng.integers(3, 7)), int(rng.integers(1, 3))
        slots = int(rng.integers(k, n_experts))
        reqs = random_requests(rng, n_experts, k, 12)
        _, loads = hits_loads(reqs, slots, BeladyPolicy(reqs.steps))
        assert loads == optimal_loads(reqs, slots), (trial, reqs.steps, slots)
        assert hits_loads(reqs, slots, make_policy("lfu"))[1] >= loads


class Checked:
    """Wraps a policy and fails if it names a pinned or non-resident victim."""

    def __init__(self, policy):
        self.policy, self.resident, self.victims = policy, set(), []

    def touch(self, e):
        self.resident.add(e)  # resident or about to be loaded (and then pinned)
        self.policy.touch(e)

    def forget(self, e):
        self.resident.discard(e)
        self.policy.forget(e)

    def victim(self, pinned):
        v = self.policy.victim(pinned)
        assert v is not None and v in self.resident and v not in set(pinned), (v, pinned)
        self.victims.append(v)
        return v


def small_model(seed=0):
    rng = np.random.default_rng(seed)
    n = len(LearnedPolicy.FEATURES)
    return NextUseModel(np.zeros(n), np.ones(n), rng.normal(size=(n, 8)), rng.normal(size=8),
                        rng.normal(size=8), np.array(0.0))


def every_policy(reqs):
    yield from ((name, make_policy(name)) for name in POLICIES if name != "learned")
    yield "learned", LearnedPolicy(small_model())
    yield "belady", BeladyPolicy(reqs.steps)


def test_policies_respect_slots_and_pins_on_random_traces():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n_experts, k = int(rng.integers(4, 20)), int(rng.integers(1, 5))
        slots = int(rng.integers(k, n_experts + 1))
        decode = rng.random(60) < 0.8  # runs of prompt tokens: calls split into passes
        routed = np.stack([rng.choice(n_experts, k, replace=False) for _ in range(60)])
        reqs = layer_requests(routed[:, None], decode, 0, slots)
        assert all(len(s) <= slots for s in reqs.steps)
        for name, policy in every_policy(reqs):
            checked = Checked(policy)
            on_step = (lambda i, p=policy: setattr(p, "step", i)) if name == "belady" else None
            counts = replay(reqs, slots, checked, on_step)
            assert counts.sum() == sum(len(s) for s in reqs.steps), name
            assert counts[:, 1].sum() - len(checked.victims) <= slots, name  # loads fill slots


def test_replay_refuses_a_policy_that_evicts_a_pinned_expert():
    class Pinned(cache.LFUPolicy):
        def victim(self, pinned):
            return list(pinned)[0]

    with pytest.raises(RuntimeError, match="not a resident, unpinned expert"):
        replay(requests([0, 1], [2, 3]), 3, Pinned())


def test_forward_calls_follow_mlx_lm_prefill():
    decode = np.array([False] * 5 + [True] * 3)
    assert forward_calls(decode) == [slice(0, 5), slice(5, 6), slice(6, 7), slice(7, 8)]


@pytest.fixture(scope="module")
def large_pack(packs):
    return Pack.open(packs["qwen3_moe_large"]["hf"])


def recorded(pack, budget, policy, prompt_len=24, max_tokens=12):
    """Generate with the real store; return its trace and counters."""
    model, _ = edgemoe.load(pack.path, expert_budget=budget, cache_policy=policy)
    store = model.expert_store
    trace = store.start_trace()
    prompt = mx.array(np.random.default_rng(0).integers(3, 500, prompt_len))
    for _ in generate_step(prompt, model, max_tokens=max_tokens):
        pass
    return trace.as_trace(), store.snapshot()


@pytest.mark.parametrize("policy,budget", [("lfu", 0.25), ("lfu", "min")])
def test_replay_matches_the_stores_counters(large_pack, policy, budget):
    if budget == "min":  # 2 slots: the prompt's distinct experts load in passes
        budget = minimum_bytes(large_pack)
    trace, stats = recorded(large_pack, budget, policy)
    r = simulate(trace, budget, policy, num_experts=32)
    assert (r.hits, r.loads) == (stats.hits, stats.loads)
    assert r.bytes_read == stats.bytes_read and r.loads > 0 and r.hits > 0


def test_learned_policy_round_trip(tmp_path):
    rng = np.random.default_rng(2)
    popular = rng.permutation(16)[:4]

    def trace(n):  # a skewed router: four experts take half the picks
        picks = [np.concatenate([rng.choice(popular, 1), rng.choice(16, 1)]) for _ in range(n)]
        routed = np.array([p if p[0] != p[1] else [p[0], (p[0] + 1) % 16] for p in picks])
        return dict(routed=routed[:, None], decode=np.ones(n, bool),
                    expert_bytes=np.array([100]))

    model = train_learned([trace(200), trace(200)], steps=200)
    model.save(tmp_path / "policy.npz")
    loaded = NextUseModel.load(tmp_path / "policy.npz")
    test = trace(200)
    reqs = layer_requests(test["routed"], test["decode"], 0, 4)
    victims = []
    for m in (model, loaded):
        checked = Checked(LearnedPolicy(m))
        replay(reqs, 4, checked)
        victims.append(checked.victims)
    assert victims[0] == victims[1] and len(victims[0]) > 50
    learned = simulate(test, 0.25, "learned", 16, loaded)
    recency = simulate(test, 0.25, cache.Recency, 16)  # evicting the least recent
    assert learned.hits > recency.hits  # it learned that popular experts come back


def test_learned_policy_in_the_registry(tmp_path, monkeypatch):
    monkeypatch.setattr(learned_module, "DEFAULT_LEARNED", tmp_path / "absent.npz")
    with pytest.raises(FileNotFoundError, match="absent.npz: no learned cache policy.*train-learned"):
        make_policy("learned")
    small_model().save(tmp_path / "w.npz")
    monkeypatch.setattr(learned_module, "DEFAULT_LEARNED", tmp_path / "w.npz")
    assert isinstance(make_policy("learned"), LearnedPolicy)


def test_lfu_evicts_the_least_used_ties_to_the_least_recent():
    lfu = make_policy("lfu")
    for e in (0, 0, 0, 1, 2, 2):
        lfu.touch(e)
    assert lfu.victim([]) == 1  # 0 used 3 times, 2 twice, 1 once
    assert lfu.victim([1]) == 2
    lfu.touch(5)
    lfu.touch(6)  # 1, 5 and 6 were used once each: the least recent of them goes
    assert lfu.victim([]) == 1 and lfu.victim([1]) == 5
    lfu.forget(0)
    lfu.touch(0)  # counts survive eviction: 0 has 4 uses now
    assert lfu.victim([1, 5, 6, 2]) == 0 and lfu.victim([1, 5, 6]) == 2


def test_lfu_leads_on_the_bundled_models_held_out_traces():
    """docs/cache.md: on routing as even as today's fine-grained MoEs' (128 experts, top-8),
    LFU, the default, beats the learned policy fitted on other passages (and beat the
    policies removed in #44: docs/benchmarks.md)."""
    from edgemoe.format.source import BUNDLED_MODEL
    from edgemoe.streaming.trace import check_trace_matches, load_trace

    folder = FINE_TRACES
    traces = [load_trace(folder / f"{d}.npz") for d in ("docs", "man", "packages", "stdlib")]
    pack = Pack.open(BUNDLED_MODEL)
    for trace in traces:
        check_trace_matches(trace, pack, "a shipped trace")  # of the bundled model
    rates = {r.policy: r.decode_hit_rate for r in run(
        traces, ["0.25"], ["lfu", "learned", "belady"],
        learned=LEARNED_01, model=NextUseModel.load(LEARNED_01))}
    assert rates["belady"] > rates["lfu"] > rates["learned"], rates


FINE_TRACES = Path(__file__).parents[1] / "edgemoe" / "models" / "fine" / "traces"
LEARNED_01 = Path(__file__).parent / "data" / "fine_learned_01.npz"  # fitted on passages 0-1 only


def shipped_trace(decoded=64):
    """The bundled model's held-out stdlib trace: its 128-token prompt and its first
    `decoded` teacher-forced tokens (the slot rules show within them; all 256 replay 4x
    longer)."""
    from edgemoe.streaming.trace import load_trace

    trace = load_trace(FINE_TRACES / "stdlib.npz")
    end = int(np.searchsorted(np.cumsum(trace["decode"]), decoded)) + 1  # rows kept
    calls = int(np.searchsorted(np.cumsum(trace["calls"]), end)) + 1
    short = {k: v for k, v in trace.items() if not k.startswith("prefetch")}
    short.update(routed=trace["routed"][:end], decode=trace["decode"][:end],
                 calls=trace["calls"][:calls])
    return short


def replay_with(trace, budget, predict, gated):
    """The store's own slots over a trace's decode calls (cache_sim's replay), with
    `predict(call, position)` prefetched for each layer as the previous layer runs."""
    from edgemoe.whatif.replay import replay_pack, replay_store, trace_calls, trace_plan
    from edgemoe.streaming.calls import passes

    routed, decode = trace["routed"], trace["decode"].astype(bool)
    plan = trace_plan(trace)
    slots = plan.slots(budget)
    store = replay_store(replay_pack(plan.expert_bytes, plan.num_experts, plan.top_k),
                         slots, "lfu")
    store.gate_prefetches(gated)
    pools = [store.pool(i) for i in range(routed.shape[1])]
    for c, call in enumerate(trace_calls(trace)):
        if not decode[call.start]:
            continue
        for position, pool in enumerate(pools):
            if predict is not None and position + 1 < len(pools):
                store.prefetch(position + 1, predict(call, position + 1), 0)
            for g, group in enumerate(passes(np.unique(routed[call, position]), slots)):
                pool.ensure(group, new_call=g == 0)
                pool.release()
    return store.snapshot()


def test_advisory_prefetch_that_is_always_wrong_costs_nothing():
    """A predictor that always names experts the next layer does not use: gated (as
    advisory routing runs) it reads no extra byte and evicts nothing that is then
    needed; ungated (as a prerouted prediction is trusted) it costs. A predictor that is
    always right is trusted after a few calls and saves loads."""
    trace = shipped_trace()
    routed = trace["routed"]
    experts = int(trace["num_experts"].max())

    def wrong(call, position):
        used = set(np.unique(routed[call, position]).tolist())
        return np.array([e for e in range(experts) if e not in used][:routed.shape[-1]])

    def right(call, position):
        return np.unique(routed[call, position])

    for budget in ("10%", "25%"):
        native = replay_with(trace, budget, None, gated=True)
        gated = replay_with(trace, budget, wrong, gated=True)
        assert gated.bytes_read <= 1.1 * native.bytes_read
        assert gated.prefetch_evicted_needed == 0 and gated.prefetches == 0
        ungated = replay_with(trace, budget, wrong, gated=False)
        assert ungated.bytes_read > 1.1 * native.bytes_read  # what the gate prevents
        assert ungated.prefetch_evicted_needed > 0 and ungated.prefetch_wasted_bytes > 0
        good = replay_with(trace, budget, right, gated=True)
        assert good.prefetches > 0 and good.on_demand < native.on_demand
        assert good.precision == 1.0


def test_a_split_fitted_to_skewed_layers_reads_less_and_the_even_one_is_kept_otherwise():
    """`cache_sim split`: a layer that always routes to the same two experts needs no more
    than two slots, so a fitted split gives the others its slots and reads fewer bytes
    on held-out traces; the total stays the even split's."""
    from edgemoe.whatif.questions import compare_split

    rng = np.random.default_rng(3)

    def trace(n):
        spread = np.array([rng.choice(16, 2, replace=False) for _ in range(n)])
        routed = np.stack([np.tile([0, 1], (n, 1)), spread], axis=1)  # (n, 2 layers, 2)
        return dict(routed=routed, decode=np.ones(n, bool), expert_bytes=np.array([100, 100]),
                    num_experts=np.array([16, 16]))

    result = compare_split([trace(300) for _ in range(4)], "25%", "lfu")
    assert result["even_slots"] == 4 and sum(result["split"]) == 8
    assert result["split"][0] == 2 and result["split"][1] == 6
    assert result["fitted_bytes_per_token"] < 0.9 * result["even_bytes_per_token"]


def test_advisory_prefetch_that_wastes_stops_within_its_waste_budget(monkeypatch):
    """A predictor half right (4 of its 8 guesses used, precision 0.5, enough to be trusted)
    whose wrong half evicts experts that are needed: each of two rules alone holds its extra
    bytes to at most 10% more than on demand reads: the waste budget (1.03x at 10%, 1.05x
    at 25%) and the rule that a guess never evicts what the policy ranks hotter (1.01x,
    1.03x); without both the same predictor reads a third more, or more (1.32x, 1.83x)."""
    from edgemoe.streaming import prefetch

    trace = shipped_trace()
    routed = trace["routed"]
    experts = int(trace["num_experts"].max())
    half = routed.shape[-1] // 2

    def half_right(call, position):
        used = np.unique(routed[call, position])
        unused = [e for e in range(experts) if e not in set(used.tolist())]
        return np.array([*used[:half], *(unused[(call.start * half + i) % len(unused)]
                                          for i in range(half))])

    def ignores_rank(self, e, pinned):
        return True

    for budget in ("10%", "25%"):
        native = replay_with(trace, budget, None, gated=True)
        both = replay_with(trace, budget, half_right, gated=True)
        assert both.prefetches > 0
        assert both.bytes_read <= 1.1 * native.bytes_read, (budget, both, native)
        with monkeypatch.context() as m:
            m.setattr(prefetch.Prefetching, "_worth_a_slot", ignores_rank)
            budget_alone = replay_with(trace, budget, half_right, gated=True)
            m.setattr(prefetch, "WASTE_BUDGET", float("inf"))
            neither = replay_with(trace, budget, half_right, gated=True)
        with monkeypatch.context() as m:
            m.setattr(prefetch, "WASTE_BUDGET", float("inf"))
            rank_alone = replay_with(trace, budget, half_right, gated=True)
        assert budget_alone.bytes_read <= 1.1 * native.bytes_read, (budget, budget_alone)
        assert rank_alone.bytes_read <= 1.1 * native.bytes_read, (budget, rank_alone)
        assert neither.bytes_read > 1.3 * native.bytes_read  # what the two rules prevent


def test_an_advisory_guess_never_evicts_what_the_policy_ranks_hotter():
    """LFU, 4 slots: a guess takes the slot of an expert used less often than itself, and
    never that of one used as often or more (nor reads at all for a never-used guess);
    a prerouted prediction (the routing itself) takes the victim's slot regardless."""
    from edgemoe.whatif.replay import replay_pack, replay_store

    def pool_after(history, gated=True):
        store = replay_store(replay_pack([100], [16], 2), 4, "lfu")
        store.gate_prefetches(gated)
        pool = store.pool(0)
        for experts in history:  # each call predicted right: the guesses earn trust
            pool.prefetch(np.array(experts))
            pool.ensure(np.array(experts))
            pool.release()
        return store, pool

    # 0 and 1 used 4 times, then evicted by a call of 4; 2 and 3 used again (the last call)
    history = [[0, 1]] * 4 + [[2, 3, 4, 5], [2, 3]]
    for guess, hotter in ((0, True), (9, False), (1, True)):
        store, pool = pool_after(history)
        assert pool.earned and pool.slot_of[guess] < 0
        before = store.snapshot()
        pool.prefetch(np.array([guess]))
        pool._wait(list(pool.fills.values()))
        after = store.snapshot()
        assert after.prefetches - before.prefetches == int(hotter)
        assert after.bytes_read - before.bytes_read == 100 * int(hotter)
        resident = {2, 3, 4, guess} if hotter else {2, 3, 4, 5}  # the victim: 5, used once
        assert set(pool.expert_in.tolist()) == resident
    store, pool = pool_after([[2, 3]] * 3 + [[4, 5]] * 3 + [[6, 7]], gated=False)
    pool.prefetch(np.array([9]))  # the routing (ungated): it must load
    pool._wait(list(pool.fills.values()))
    assert pool.slot_of[9] >= 0


def test_windows_replay_decode_in_speculative_windows(tmp_path, capsys):
    """`cache_sim windows`: one token a window is the trace as recorded; where no token
    shares an expert with another, a window reads exactly what its tokens would alone;
    the command prints and writes a row per budget and window."""
    import json

    from edgemoe.cache_sim import main
    from edgemoe.whatif.questions import compare_windows, windowed
    from edgemoe.whatif.replay import simulate

    trace = shipped_trace()
    shipped = tmp_path / "stdlib_64.npz"
    np.savez(shipped, **trace)
    one = simulate(windowed(trace, 1), "10%", "lfu")
    assert one.decode_bytes_read == simulate(trace, "10%", "lfu").decode_bytes_read
    n = 24  # 4 prompt tokens, 20 decoded, each routed to 2 experts no other token uses
    fresh = dict(routed=np.arange(2 * n).reshape(n, 1, 2), decode=np.arange(n) >= 4,
                 expert_bytes=np.array([100]), num_experts=np.array([2 * n]))
    rows = compare_windows([fresh], "25%", [1, 2, 3, 4, 8], "lfu")
    assert [r["ratio_to_plain"] for r in rows] == [1.0] * 5
    assert rows[0]["bytes_per_token"] == 200
    main(["windows", str(shipped), "--budget", "0.1,0.25", "--window", "1,4",
          "--json", str(tmp_path / "w.json")])
    written = json.loads((tmp_path / "w.json").read_text())
    assert [(r["budget"], r["window"]) for r in written] == [
        ("0.1", 1), ("0.1", 4), ("0.25", 1), ("0.25", 4)]
    assert "every draft kept" in capsys.readouterr().out
