"""Prerouter heads: the family's routing math, save/load, deterministic training, and
advisory prefetch with the trained heads staying bit-identical to native routing."""

import dataclasses
import pydoc

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe import train_prerouter
from edgemoe.routing.gates import (RouterTap, gate_logits, indices_from_logits, install_tap,
                                   moe_blocks, restrict_logits, top_k)
from edgemoe.routing.predictors import HeadsPredictor
from edgemoe.routing.prerouter import Prerouter, PrerouterConfig, load_prerouter, save_prerouter
from edgemoe.routing.state import RoutingState, sequence_state
from edgemoe.streaming.budget import minimum_bytes

from conftest import FAMILIES


def new_prerouter(model, model_type, seed=0, **options):
    mx.random.seed(seed)
    blocks = moe_blocks(model)
    config = PrerouterConfig.for_model(model_type, model.args.hidden_size, blocks,
                                       head_hidden=32, **options)
    return Prerouter(config), blocks


def inputs(model, blocks, layer, length=7, seed=1):
    rng = np.random.default_rng(seed)
    x = mx.array(rng.standard_normal((1, length, model.args.hidden_size)).astype(np.float32))
    return x, indices_from_logits(blocks[layer], gate_logits(blocks[layer], x))


@pytest.mark.parametrize("family", FAMILIES)
def test_head_shapes(packs, family):
    model, _ = edgemoe.load(packs[family]["hf"])
    prerouter, blocks = new_prerouter(model, family)
    layers = sorted(blocks)
    assert prerouter.config.targets == layers[1:]
    assert prerouter.config.native_layers == layers[:1]
    assert all(prerouter.config.sources[b] == a for a, b in zip(layers, layers[1:]))
    for target, source in prerouter.config.sources.items():
        x, now = inputs(model, blocks, source)
        logits = prerouter.logits(target, x, now, now)
        assert logits.shape == (1, 7, prerouter.config.num_experts)
        inds = prerouter.route(target, blocks[target], x, now)
        assert inds.shape == (1, 7, top_k(blocks[target]))
        assert 0 <= mx.min(inds).item() and mx.max(inds).item() < prerouter.config.num_experts


class RevealWeights(nn.Module):
    """An expert module whose output row j is the unit vector e_j: the block's weighted
    sum of expert outputs then holds the routing weights in its first k entries."""

    def __call__(self, x, indices):
        self.indices = indices
        unit = (mx.arange(x.shape[-1])[None] == mx.arange(indices.shape[-1])[:, None])
        return mx.broadcast_to(unit.astype(x.dtype), (*indices.shape, x.shape[-1]))


def native_routing(block, x):
    """The indices and weights the block itself routes `x` with, read off its output."""
    reveal, expert_module = RevealWeights(), block.switch_mlp
    config = getattr(block, "config", None)
    block.switch_mlp = reveal
    if config is not None:  # DeepSeek: leave the shared expert out of the sum
        block.config = dataclasses.replace(config, n_shared_experts=None)
    try:
        y = block(x)
    finally:
        block.switch_mlp = expert_module
        if config is not None:
            block.config = config
    k = reveal.indices.shape[-1]
    return reveal.indices, y.reshape(*reveal.indices.shape[:-1], -1)[..., :k]


@pytest.mark.parametrize("family", FAMILIES)
def test_indices_from_native_logits_are_native(checkpoints, family):
    model, _ = mlx_lm_load(str(checkpoints[family][1]))
    blocks = moe_blocks(model)
    for layer, block in blocks.items():
        x, _ = inputs(model, blocks, layer, length=9, seed=layer)
        x = x * 4  # spread the router logits so that no two tie
        native_inds, _ = native_routing(block, x)
        inds = indices_from_logits(block, gate_logits(block, x))
        assert mx.array_equal(inds.reshape(native_inds.shape), native_inds), (family, layer)
        # and it really is the family's routing: other logits route elsewhere
        other = indices_from_logits(block, -gate_logits(block, x))
        assert not mx.array_equal(other.reshape(native_inds.shape), native_inds)


def test_save_load_round_trip(packs, tmp_path):
    model, _ = edgemoe.load(packs["deepseek_v3"]["hf"])
    prerouter, blocks = new_prerouter(model, "deepseek_v3", native_layers=[3])
    save_prerouter(prerouter, tmp_path / "prerouter")
    loaded = load_prerouter(tmp_path / "prerouter")
    assert loaded.config == prerouter.config
    assert loaded.config.predicted_layers == [2]
    for target, source in prerouter.config.sources.items():
        x, now = inputs(model, blocks, source)
        assert mx.array_equal(loaded.logits(target, x, now, now[:, ::-1]),
                              prerouter.logits(target, x, now, now[:, ::-1]))
    with pytest.raises(FileNotFoundError, match="prerouter_config.json"):
        load_prerouter(tmp_path)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(pydoc.getdoc(o) for o in (dict, str, list, set, pytest)))
    return path


def train_args(checkpoints, text_file, out, **changes):
    args = dict(model=str(checkpoints["qwen3_moe"][1]), data=str(text_file), out=str(out),
                eval_data=None, hidden=32, epochs=2, seed=0, same_token=False,
                native_layers="", context=32, batch_size=16, lr=1e-3, max_steps=12,
                max_train_tokens=1200, max_eval_tokens=0)
    args.update(changes)
    return train_prerouter.argparse.Namespace(**args)


@pytest.fixture(scope="module")
def trained(checkpoints, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("trained")
    report = train_prerouter.run(train_args(checkpoints, text_file, out))
    return out, report


def weights(folder):
    return mx.load(str(folder / "prerouter.safetensors"))


def test_training_is_deterministic_and_resumable(checkpoints, text_file, trained, tmp_path):
    out, report = trained
    assert report["variant"] == "next_token" and len(report["train_loss"]) == 2
    assert report["train_loss"][1] < report["train_loss"][0]
    for layer in report["layers"]:
        for key in ("head", "baseline_next_token", "baseline_same_token"):
            assert 0.0 <= layer[key]["exact"] <= layer[key]["recall"] <= 1.0
    first = weights(out / "prerouter")

    again = tmp_path / "again"  # from scratch in two runs: one epoch, then resumed
    train_prerouter.run(train_args(checkpoints, text_file, again, epochs=1))
    train_prerouter.run(train_args(checkpoints, text_file, again))
    second = weights(again / "prerouter")
    assert first.keys() == second.keys()
    assert all(mx.array_equal(first[k], second[k]) for k in first)

    other = tmp_path / "other"
    other.mkdir()
    (other / "features").symlink_to(out / "features")
    train_prerouter.run(train_args(checkpoints, text_file, other, seed=1))
    third = weights(other / "prerouter")
    assert not all(mx.array_equal(first[k], third[k]) for k in first)


@pytest.mark.parametrize("history", [1, 2])
def test_predictor_carries_the_previous_token(packs, history):
    """Token by token or all at once, the heads see the same t-1 (and t-2) routing."""
    model, _ = edgemoe.load(packs["olmoe"]["hf"])
    prerouter, blocks = new_prerouter(model, "olmoe", same_token=True, history=history)
    predictor = HeadsPredictor(prerouter, blocks)
    source, target = 1, 2
    x, now = inputs(model, blocks, source, length=6)
    whole = np.array(predictor.predict(RoutingState(), source, x, now)[target, 0])
    state = RoutingState()
    steps = [np.array(predictor.predict(state, source, x[:, i:i + 1], now[:, i:i + 1])[target, 0])
             for i in range(6)]
    assert np.array_equal(np.concatenate(steps, axis=1), whole)
    state = RoutingState()  # a new request starts with no previous token
    first = np.array(predictor.predict(state, source, x[:, :1], now[:, :1])[target, 0])
    assert np.array_equal(first, whole[:, :1])
    shifted = np.array(predictor.predict(state, source, x[:, :1], now[:, :1])[target, 0])
    expected = prerouter.route(target, blocks[target], x[:, :1], now[:, :1], now[:, :1])
    assert np.array_equal(shifted, np.array(expected))
    if history == 2:  # the third step reads the two before it, most recent first
        third = predictor.predict(state, source, x[:, 1:2], now[:, 1:2])[target, 0]
        earlier = mx.stack([now[:, :1], now[:, :1]], axis=2)
        expected = prerouter.route(target, blocks[target], x[:, 1:2], now[:, 1:2], earlier)
        assert np.array_equal(np.array(third), np.array(expected))
        other = mx.stack([now[:, :1], now[:, 1:2]], axis=2)  # another t-2: another guess
        assert not mx.array_equal(prerouter.logits(target, x[:, 1:2], now[:, 1:2], earlier),
                                  prerouter.logits(target, x[:, 1:2], now[:, 1:2], other))


def test_heads_that_read_two_earlier_tokens_train_and_route(checkpoints, text_file, packs,
                                                            tmp_path):
    """train_prerouter --history 2 (as Edge0): the heads read the routing of t-1 and t-2,
    train from the recorded features, and route a prerouted decode that loads nothing on
    demand at the predicted layers."""
    from edgemoe.format.pack import Pack

    report = train_prerouter.run(train_args(checkpoints, text_file, tmp_path, history=2))
    heads = load_prerouter(tmp_path / "prerouter")
    assert heads.config.history == 2 and report["train_loss"][1] < report["train_loss"][0]
    assert heads.head(1).up.weight.shape[1] == heads.config.hidden_size + 3 * 16
    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=minimum_bytes(Pack.open(path)),
                            routing="prerouted", prerouter_path=tmp_path / "prerouter")
    _, on_demand = decode_steps(model, mx.array(np.random.default_rng(5).integers(3, 500, 20)))
    assert all(on_demand[l] == 0 for l in (1, 2, 3)), on_demand


def test_heads_that_read_more_layers_and_go_deeper_train_and_route(checkpoints, text_file,
                                                                    packs, tmp_path):
    """train_prerouter --inputs 2 --depth 2: a head reads its source layer's input and the
    MoE layer's before it (zeros before the first), at the same token, through two hidden
    layers; it trains from the recorded features and routes a prerouted decode that loads
    nothing on demand at the predicted layers."""
    from edgemoe.format.pack import Pack

    report = train_prerouter.run(train_args(checkpoints, text_file, tmp_path, inputs=2,
                                            depth=2))
    heads = load_prerouter(tmp_path / "prerouter")
    assert (heads.config.inputs, heads.config.depth, report["inputs"]) == (2, 2, 2)
    assert report["train_loss"][1] < report["train_loss"][0]
    width = heads.config.hidden_size
    assert heads.head(1).up.weight.shape[1] == 2 * width + 2 * 16
    assert len(heads.head(1).deep) == 1
    assert heads.config.input_layers(1) == [0, None] and heads.config.input_layers(3) == [2, 1]

    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    blocks = moe_blocks(model)
    predictor, state = HeadsPredictor(heads, blocks), RoutingState()
    xs = {l: inputs(model, blocks, l, length=3, seed=l) for l in (0, 1, 2)}
    got = {l: predictor.predict(state, l, *xs[l]) for l in (0, 1, 2)}  # one call's layers
    for source, before in ((2, xs[1][0]), (0, mx.zeros_like(xs[0][0]))):
        x, now = xs[source]
        expected = heads.route(source + 1, blocks[source + 1],
                               mx.concatenate([x, before], axis=-1)[:, -1], now[:, -1],
                               now[:, -2])
        assert np.array_equal(np.array(got[source][source + 1, 1]), np.array(expected))

    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path, expert_budget=minimum_bytes(Pack.open(path)),
                            routing="prerouted", prerouter_path=tmp_path / "prerouter")
    _, on_demand = decode_steps(model, mx.array(np.random.default_rng(5).integers(3, 500, 20)))
    assert all(on_demand[l] == 0 for l in (1, 2, 3)), on_demand


def decode_logits(model, tokens, steps=16, cache=None):
    cache = cache if cache is not None else make_prompt_cache(model)
    out = model(tokens[None], cache=cache)
    logits = [out[0]]
    for _ in range(steps):
        out = model(mx.argmax(out[:, -1], -1)[None], cache=cache)
        logits.append(out[0])
    return mx.concatenate(logits)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_advisory_with_prerouter_is_exact(packs, trained, family):
    tokens = mx.array(np.random.default_rng(3).integers(3, 500, 24))
    native, _ = edgemoe.load(packs[family]["hf"], expert_budget=0.5, routing="native")
    expected = decode_logits(native, tokens)
    model, _ = edgemoe.load(packs[family]["hf"], expert_budget=0.5, routing="advisory")
    blocks = moe_blocks(model)
    if family == "qwen3_moe":  # the heads trained on this model, through load()
        model, _ = edgemoe.load(packs[family]["hf"], expert_budget=0.5, routing="advisory",
                                prerouter_path=trained[0] / "prerouter")
        assert isinstance(edgemoe.streaming_of(model).routing.predictor, HeadsPredictor)
        blocks = moe_blocks(model)
    else:
        prerouter, _ = new_prerouter(model, family)
        edgemoe.streaming_of(model).routing.predictor = HeadsPredictor(prerouter, blocks)
    # every prediction read ahead, right or not (advisory gates them by their precision:
    # untrained heads would read nothing), and still the native output
    model.expert_store.gate_prefetches(False)
    cache = make_prompt_cache(model)
    got = decode_logits(model, tokens, cache=cache)
    assert mx.array_equal(got, expected)
    stats = model.expert_store.snapshot()
    assert stats.predicted > 0 and stats.prefetches > 0  # the heads did steer reads
    assert set(sequence_state(cache).previous) == set(blocks)  # kept beside the KV cache


@pytest.mark.parametrize("family", FAMILIES)
def test_predicted_gate_routes_by_the_given_logits(checkpoints, family):
    """With the native logits as the prediction, a block gives its native output bit
    for bit; with other logits, other output; with none pending, native again."""
    model, _ = mlx_lm_load(str(checkpoints[family][1]))
    blocks = moe_blocks(model)
    layer = sorted(blocks)[-1]
    block = blocks[layer]
    x, _ = inputs(model, blocks, layer, length=5)
    native = block(x)
    logits = gate_logits(block, x)
    tap = install_tap(block)
    assert indices_from_logits(block, logits).shape[-1] == top_k(block)
    tap.set_prediction(logits)
    assert mx.array_equal(block(x), native)
    assert tap.pending == (None, None, True) and "pending" not in tap
    tap.set_prediction(logits, fallback=False)  # known to cover every row: no native map
    assert mx.array_equal(block(x), native)
    tap.set_prediction(-logits)
    assert not mx.array_equal(block(x), native)
    assert mx.array_equal(block(x), native)
    nan_rows = mx.where(mx.arange(x.shape[1])[:, None] < 2, mx.nan, logits)
    tap.set_prediction(nan_rows)  # rows without a prediction keep the native logits
    assert mx.array_equal(block(x), native)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_restricted_routing_stays_in_the_allowed_set(checkpoints, family):
    model, _ = mlx_lm_load(str(checkpoints[family][1]))
    blocks = moe_blocks(model)
    layer = sorted(blocks)[-1]
    block = blocks[layer]
    x, native = inputs(model, blocks, layer, length=5)
    logits = gate_logits(block, x)
    same = indices_from_logits(block, restrict_logits(logits, native))
    assert mx.array_equal(mx.sort(same, -1), mx.sort(native, -1))
    others = mx.array(np.setdiff1d(np.arange(logits.shape[-1]), np.array(native[0, 0])))
    inds = indices_from_logits(block, restrict_logits(logits[:, :1], others[None, None]))
    assert not np.isin(np.array(inds), np.array(native[0, 0])).any()
    install_tap(block).set_prediction(allowed=others[None, None])
    assert mx.all(mx.isfinite(block(x[:, :1]))).item()  # the weights too


def decode_steps(model, prompt, steps=16):
    """Prefill, then greedy decode; per-layer on-demand loads counted for decode only."""
    cache = make_prompt_cache(model)
    out = model(prompt[None], cache=cache)
    store = model.expert_store
    before = store.on_demand_by_layer()
    logits = []
    for _ in range(steps):
        out = model(mx.argmax(out[:, -1], -1)[None], cache=cache)
        logits.append(out[0, -1])
    after = store.on_demand_by_layer()
    return mx.stack(logits), {l: after[l] - before[l] for l in after}


@pytest.mark.parametrize("budget", [0.25, "minimum"])
@pytest.mark.parametrize("mode", ["prerouted", "prerouted-set"])
def test_prerouted_decode_never_loads_on_demand(packs, trained, mode, budget):
    from edgemoe.format.pack import Pack

    path = packs["qwen3_moe"]["hf"]
    if budget == "minimum":
        budget = minimum_bytes(Pack.open(path))
    heads = trained[0] / "prerouter"
    model, _ = edgemoe.load(path, expert_budget=budget, routing=mode, prerouter_path=heads)
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))
    logits, on_demand = decode_steps(model, prompt)
    predicted = set(load_prerouter(heads).config.predicted_layers)
    assert predicted == {1, 2, 3}  # the first MoE layer stays native
    assert all(on_demand[l] == 0 for l in predicted), on_demand
    stats = model.expert_store.snapshot()
    assert stats.prefetches > 0 and stats.predicted > 0
    native, _ = edgemoe.load(path, expert_budget=budget)
    native_logits, native_on_demand = decode_steps(native, prompt)
    assert sum(native_on_demand.values()) > 0  # at this budget native routing does load
    assert not mx.array_equal(logits, native_logits)  # the routing really changed
    assert mx.isfinite(logits).all()


def test_prerouted_set_routes_only_to_predicted_experts(checkpoints):
    """The native router confined to an allowed set picks only from it; rows with no
    prediction (-1) route natively."""
    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    block = moe_blocks(model)[2]
    x = mx.array(np.random.default_rng(0).standard_normal((1, 3, 64)).astype(np.float32))
    native_inds = mx.argpartition(block.gate(x), kth=-2, axis=-1)[..., -2:]
    gate = RouterTap(block.gate)
    allowed = mx.array([[[4, 9, 11], [0, 1, 2], [-1, -1, -1]]])
    gate.set_prediction(allowed=allowed)
    inds = mx.argpartition(gate(x), kth=-2, axis=-1)[..., -2:]
    assert set(np.array(inds[0, 0]).tolist()) <= {4, 9, 11}
    assert set(np.array(inds[0, 1]).tolist()) <= {0, 1, 2}
    assert set(np.array(inds[0, 2]).tolist()) == set(np.array(native_inds[0, 2]).tolist())
    gate.set_prediction(mx.full((1, 3, 16), mx.nan))  # no prediction anywhere: native
    assert mx.array_equal(gate(x), block.gate(x))


def test_prerouted_needs_heads(packs):
    with pytest.raises(ValueError, match="needs prerouter heads"):
        edgemoe.load(packs["qwen3_moe"]["hf"], routing="prerouted")


@pytest.fixture(scope="module")
def trained_same_token(checkpoints, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("same")
    train_prerouter.run(train_args(checkpoints, text_file, out, same_token=True))
    return out / "prerouter"


def test_same_token_heads_route_each_position_by_its_own_prediction(packs, checkpoints):
    """A same-token head run at layer 1 gives layer 2's routing for the same positions (no
    shift, nothing carried), and those experts are read ahead at once (lead 0)."""
    from edgemoe.routing.predictors import PreroutedPredictor

    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    prerouter, blocks = new_prerouter(model, "qwen3_moe", same_token=True)
    predictor = PreroutedPredictor(prerouter, blocks)
    x, ids = inputs(model, blocks, 1)
    state = RoutingState()
    ahead = predictor.predict(state, 1, x, ids)
    logits = prerouter.logits(2, x, ids, mx.concatenate(
        [mx.full((1, 1, ids.shape[-1]), -1, dtype=mx.int32), ids[:, :-1]], axis=1))
    assert list(ahead) == [(2, 0)] and not state.carry
    assert mx.allclose(predictor.taps[2].pending[0], logits, atol=1e-6)
    assert mx.array_equal(ahead[2, 0], indices_from_logits(blocks[2], logits))


@pytest.mark.parametrize("mode", ["prerouted", "prerouted-set"])
def test_same_token_prerouted_decode_never_loads_on_demand(packs, trained_same_token, mode):
    """Each predicted layer's experts are read while the layer before it computes, so
    none loads on demand, and the routing is the heads' (not native)."""
    from edgemoe.format.pack import Pack

    path = packs["qwen3_moe"]["hf"]
    budget = minimum_bytes(Pack.open(path))
    model, _ = edgemoe.load(path, expert_budget=budget, routing=mode,
                            prerouter_path=trained_same_token)
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))
    logits, on_demand = decode_steps(model, prompt)
    assert all(on_demand[l] == 0 for l in (1, 2, 3)), on_demand
    assert model.expert_store.snapshot().prefetches > 0
    native, _ = edgemoe.load(path, expert_budget=budget)
    native_logits, _ = decode_steps(native, prompt)
    assert not mx.array_equal(logits, native_logits)


@pytest.fixture(scope="module")
def corrected(trained, trained_same_token, tmp_path_factory):
    """Next-token heads carrying same-token heads as their correction."""
    import shutil

    folder = tmp_path_factory.mktemp("corrected") / "prerouter"
    shutil.copytree(trained[0] / "prerouter", folder)
    shutil.copytree(trained_same_token, folder / "correction")
    return folder


def test_a_correction_routes_and_the_next_token_heads_read_ahead(checkpoints):
    """With a correction, layer 2 routes by the same-token heads' prediction for this
    call (no shift, nothing carried), read at once (lead 0); the next-token heads'
    prediction for the next token is read a token ahead (lead 1)."""
    from edgemoe.routing.predictors import PreroutedPredictor

    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    heads, blocks = new_prerouter(model, "qwen3_moe", seed=0)
    correction, _ = new_prerouter(model, "qwen3_moe", seed=1, same_token=True)
    predictor = PreroutedPredictor(heads, blocks, correction=correction)
    x, ids = inputs(model, blocks, 1)
    state = RoutingState()
    predictions = predictor.predict(state, 1, x, ids)
    prev = mx.concatenate([mx.full((1, 1, ids.shape[-1]), -1, dtype=mx.int32), ids[:, :-1]], 1)
    corrected = correction.logits(2, x, ids, prev)
    ahead = heads.logits(2, x, ids, prev)[:, -1]
    assert sorted(predictions) == [(2, 0), (2, 1)] and not state.carry
    assert mx.allclose(predictor.taps[2].pending[0], corrected, atol=1e-6)
    assert mx.array_equal(predictions[2, 0], indices_from_logits(blocks[2], corrected))
    assert mx.array_equal(predictions[2, 1], indices_from_logits(blocks[2], ahead))
    with pytest.raises(ValueError, match="same-token heads"):
        PreroutedPredictor(correction, blocks, correction=correction)


def test_a_corrected_decode_is_the_corrections_and_reads_a_token_ahead(
        packs, trained_same_token, corrected):
    """Heads carrying a correction decode exactly as the correction's same-token heads
    alone (they route), load nothing on demand at a predicted layer, and also read the
    next-token heads' prediction a token ahead."""
    from edgemoe.format.pack import Pack

    path = packs["qwen3_moe"]["hf"]
    budget = minimum_bytes(Pack.open(path)) * 4  # room for the lookahead to use
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))
    runs = {}
    for name, heads in (("same-token", trained_same_token), ("corrected", corrected)):
        model, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                                prerouter_path=heads)
        logits, on_demand = decode_steps(model, prompt)
        runs[name] = logits, on_demand, model.expert_store.snapshot()
        model.expert_store.close()
    assert mx.array_equal(runs["corrected"][0], runs["same-token"][0])
    assert all(runs["corrected"][1][l] == 0 for l in (1, 2, 3)), runs["corrected"][1]
    same, both = runs["same-token"][2], runs["corrected"][2]
    assert both.prefetches > same.prefetches


def test_a_corrections_lookahead_reads_only_while_it_earns_it(packs, trained_same_token,
                                                               tmp_path, monkeypatch):
    """The next-token heads beside a correction no longer route: their reads a token ahead
    are advisory, held to the store's waste budget. Next-token heads that guess wrong
    (random, sharp) cost at most 10% more bytes than the correction alone; read
    unconditionally, they cost far more."""
    import shutil

    from mlx.utils import tree_map

    from edgemoe.format.pack import Pack
    from edgemoe.streaming import slots

    path = packs["qwen3_moe"]["hf"]
    model, _ = edgemoe.load(path)
    wrong, _ = new_prerouter(model, "qwen3_moe", seed=3)
    wrong.update(tree_map(lambda a: a * 8, wrong.parameters()))  # confident, and wrong
    heads = save_prerouter(wrong, tmp_path / "wrong")
    shutil.copytree(trained_same_token, heads / "correction")
    budget = minimum_bytes(Pack.open(path)) * 2
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))

    def bytes_read(folder):
        m, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                            prerouter_path=folder)
        decode_steps(m, prompt, steps=96)
        read = m.expert_store.snapshot().bytes_read
        m.expert_store.close()
        return read

    alone, gated = bytes_read(trained_same_token), bytes_read(heads)
    monkeypatch.setattr(slots, "WASTE_BUDGET", float("inf"))  # every guess earns its reads
    ungated = bytes_read(heads)
    print(alone, gated, ungated)
    assert gated <= 1.1 * alone < ungated


@pytest.fixture(scope="module")
def trained_first(checkpoints, text_file, tmp_path_factory):
    """Next-token heads with a first-layer head; and same-token ones with one."""
    heads = {}
    for same_token in (False, True):
        out = tmp_path_factory.mktemp("first")
        report = train_prerouter.run(train_args(checkpoints, text_file, out,
                                                same_token=same_token, first_layer=True))
        heads[same_token] = out / "prerouter", report
    return heads


def test_a_first_layer_head_runs_at_the_last_layer_about_the_next_token(checkpoints):
    """The first MoE layer's head is sourced at the last and predicts the next token in
    both variants, for the first layer's next call (lead 0); the first layer keeps its
    router (its prediction is advisory: it only reads ahead)."""
    from edgemoe.routing.predictors import PreroutedPredictor

    model, _ = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))
    for same_token in (False, True):
        prerouter, blocks = new_prerouter(model, "qwen3_moe", same_token=same_token,
                                          first_layer=True)
        config = prerouter.config
        layers = sorted(blocks)
        assert config.sources[layers[0]] == layers[-1] and config.wraps(layers[0])
        assert config.shift(layers[0]) == 1 and config.shift(layers[1]) == int(not same_token)
        assert config.native_layers == layers[:1]
    prerouter, blocks = new_prerouter(model, "qwen3_moe", first_layer=True)
    predictor = PreroutedPredictor(prerouter, blocks)
    assert 0 not in predictor.taps and predictor.advisory_targets == (0,)
    x, ids = inputs(model, blocks, 3)
    state = RoutingState()
    predictions = predictor.predict(state, 3, x, ids)
    logits = prerouter.logits(0, x[:, -1], ids[:, -1], ids[:, -2])
    assert list(predictions) == [(0, 0)] and 0 not in state.carry
    assert mx.array_equal(predictions[0, 0], indices_from_logits(blocks[0], logits))


@pytest.mark.parametrize("same_token", [False, True])
def test_a_first_layer_head_only_reads_ahead(packs, trained_first, tmp_path, same_token):
    """Heads with a first-layer head decode exactly as the same heads without it (the
    first layer keeps its router), and read the first layer's predicted experts ahead."""
    from edgemoe.format.pack import Pack

    heads, report = trained_first[same_token]
    assert [r["target"] for r in report["layers"]] == [0, 1, 2, 3]
    assert report["layers"][0]["source"] == 3 and report["layers"][0]["next_token"]
    config = load_prerouter(heads).config
    alone = dataclasses.replace(config, first_layer=False, sources={
        t: s for t, s in config.sources.items() if not config.wraps(t)})
    stripped = Prerouter(alone)
    stripped.update({"heads": {k: v for k, v in load_prerouter(heads).parameters()["heads"]
                               .items() if k != "layer_0"}})
    save_prerouter(stripped, tmp_path / "alone")
    path = packs["qwen3_moe"]["hf"]
    runs = {}
    for name, folder in (("first", heads), ("alone", tmp_path / "alone")):
        model, _ = edgemoe.load(path, expert_budget=minimum_bytes(Pack.open(path)) * 4,
                                routing="prerouted", prerouter_path=folder)
        logits, _ = decode_steps(model, mx.array(np.random.default_rng(5).integers(
            3, 500, 20)))
        runs[name] = logits, model.expert_store.snapshot()
        model.expert_store.close()
    assert mx.array_equal(runs["first"][0], runs["alone"][0])
    assert runs["first"][1].predicted > runs["alone"][1].predicted  # layer 0's guesses


@pytest.mark.parametrize("heads", ["next-token", "with a first-layer head"])
def test_a_decode_step_of_next_token_routing_skips_the_routing_sync(packs, trained,
                                                                    trained_first,
                                                                    monkeypatch, heads):
    """A predicted layer's decode routing is on the host a token early (its next-token
    prediction): the step skips that layer's routing sync, one host sync a layer instead
    of two, and computes exactly what the step with the sync computes."""
    from edgemoe.format.pack import Pack
    from edgemoe.routing.driver import PredictedRouting

    folder = trained[0] / "prerouter" if heads == "next-token" else trained_first[False][0]
    path = packs["qwen3_moe"]["hf"]
    budget = minimum_bytes(Pack.open(path)) * 2
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))
    runs = {}
    for name in ("skipping", "syncing"):
        with monkeypatch.context() as m:
            if name == "syncing":
                m.setattr(PredictedRouting, "known_routing", lambda self, layer, shape: None)
            model, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                                    prerouter_path=folder)
            before = model.expert_store.snapshot().host_syncs
            logits, _ = decode_steps(model, prompt, steps=8)
            syncs = model.expert_store.snapshot().host_syncs - before
            runs[name] = logits, syncs
            model.expert_store.close()
    layers, predicted = 4, len(load_prerouter(folder).config.predicted_layers)
    prefill = runs["syncing"][1] - 8 * 2 * layers  # (decode_steps counts from before it)
    assert mx.array_equal(runs["skipping"][0], runs["syncing"][0])
    assert runs["skipping"][1] - prefill == 8 * (2 * layers - predicted)


def test_stepwise_eval_scores_as_decode_routes(packs, trained, trained_first):
    """`edgemoe.eval --stepwise` scores a token a call, as decode runs: for native routing
    and next-token heads (with a first-layer head or not) that is what one call per window
    scores, their shift being the same within a call and from call to call."""
    from edgemoe.eval import compare

    path = packs["qwen3_moe"]["hf"]
    tokens = np.random.default_rng(7).integers(3, 500, 49).tolist()

    def nll(stepwise, **options):
        model, _ = edgemoe.load(path, **options)
        return compare([model], tokens, context=24, stepwise=stepwise)["nll"][0]

    for heads in (None, trained[0] / "prerouter", trained_first[False][0]):
        options = {} if heads is None else {"routing": "prerouted", "prerouter_path": heads}
        assert abs(nll(True, **options) - nll(False, **options)) < 1e-3, options
    other = nll(True, routing="prerouted", prerouter_path=trained[0] / "prerouter")
    assert abs(other - nll(True)) > 1e-3  # (the routing does change the score)
