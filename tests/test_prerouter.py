"""Prerouter heads: the family's routing math, save/load (heads saved with a removed
variant's fields), deterministic training, and the prerouted mode they drive."""

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
from edgemoe.mlx_backend.gates import gate_logits, indices_from_logits, install_tap, moe_blocks, top_k
from edgemoe.mlx_backend.predictors import PreroutedPredictor
from edgemoe.mlx_backend.prerouter import Prerouter, config_for_model, load_prerouter, save_prerouter
from edgemoe.mlx_backend.state import RoutingState
from edgemoe.streaming.budget import minimum_bytes

from conftest import FAMILIES


def new_prerouter(model, model_type, seed=0, **options):
    mx.random.seed(seed)
    blocks = moe_blocks(model)
    config = config_for_model(model_type, model.args.hidden_size, blocks, **options)
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


def test_heads_saved_with_a_removed_variants_fields_load_at_their_plain_values(packs,
                                                                              tmp_path):
    """Heads saved before the head variants left (#44) record their fields, as the
    shipped heads do: at the plain values they load as before; at any other, the error
    names the file and the field."""
    import json

    model, _ = edgemoe.load(packs["qwen3_moe"]["hf"])
    prerouter, _ = new_prerouter(model, "qwen3_moe")
    folder = save_prerouter(prerouter, tmp_path / "old")
    config = folder / "prerouter_config.json"
    old = dict(json.loads(config.read_text()), head_hidden=256, first_layer=False, history=1,
               inputs=1, depth=1)
    config.write_text(json.dumps(old))
    assert load_prerouter(folder).config == prerouter.config
    for field, value in (("history", 2), ("first_layer", True), ("head_hidden", 32),
                         ("inputs", 2), ("depth", 2)):
        config.write_text(json.dumps(dict(old, **{field: value})))
        with pytest.raises(ValueError, match=f"prerouter_config.json: {field} {value}"):
            load_prerouter(folder)


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "text.txt"
    path.write_text("\n".join(pydoc.getdoc(o) for o in (dict, str, list, set, pytest)))
    return path


def train_args(checkpoints, text_file, out, **changes):
    args = dict(model=str(checkpoints["qwen3_moe"][1]), data=str(text_file), out=str(out),
                eval_data=None, epochs=2, seed=0, same_token=False,
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
    recorded = {split: (again / "features" / split / "meta.json").stat().st_mtime_ns
                for split in ("train", "eval")}
    train_prerouter.run(train_args(checkpoints, text_file, again))
    assert recorded == {split: (again / "features" / split / "meta.json").stat().st_mtime_ns
                        for split in ("train", "eval")}  # the resumed run records neither again
    second = weights(again / "prerouter")
    assert first.keys() == second.keys()
    assert all(mx.array_equal(first[k], second[k]) for k in first)

    other = tmp_path / "other"
    other.mkdir()
    (other / "features").symlink_to(out / "features")
    train_prerouter.run(train_args(checkpoints, text_file, other, seed=1))
    third = weights(other / "prerouter")
    assert not all(mx.array_equal(first[k], third[k]) for k in first)


def test_predictor_carries_the_previous_token(packs):
    """Token by token or all at once, the heads see the same t-1 routing."""
    model, _ = edgemoe.load(packs["olmoe"]["hf"])
    prerouter, blocks = new_prerouter(model, "olmoe", same_token=True)
    predictor = PreroutedPredictor(prerouter, blocks)
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
    assert tap.pending == (None, True) and "pending" not in tap
    tap.set_prediction(logits, fallback=False)  # known to cover every row: no native map
    assert mx.array_equal(block(x), native)
    tap.set_prediction(-logits)
    assert not mx.array_equal(block(x), native)
    assert mx.array_equal(block(x), native)
    nan_rows = mx.where(mx.arange(x.shape[1])[:, None] < 2, mx.nan, logits)
    tap.set_prediction(nan_rows)  # rows without a prediction keep the native logits
    assert mx.array_equal(block(x), native)


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
def test_prerouted_decode_never_loads_on_demand(packs, trained, budget):
    from edgemoe.format.pack import Pack

    path = packs["qwen3_moe"]["hf"]
    if budget == "minimum":
        budget = minimum_bytes(Pack.open(path))
    heads = trained[0] / "prerouter"
    model, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                            prerouter_path=heads)
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


def test_prerouted_needs_heads_and_advisory_takes_none(packs, trained):
    with pytest.raises(ValueError, match="needs prerouter heads"):
        edgemoe.load(packs["qwen3_moe"]["hf"], routing="prerouted")
    with pytest.raises(ValueError, match="advisory routing prefetches by the next layer's"):
        edgemoe.load(packs["qwen3_moe"]["hf"], routing="advisory",
                     prerouter_path=trained[0] / "prerouter")


@pytest.fixture(scope="module")
def trained_same_token(checkpoints, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("same")
    train_prerouter.run(train_args(checkpoints, text_file, out, same_token=True))
    return out / "prerouter"


def test_same_token_heads_route_each_position_by_its_own_prediction(packs, checkpoints):
    """A same-token head run at layer 1 gives layer 2's routing for the same positions (no
    shift, nothing carried), and those experts are read ahead at once (lead 0)."""
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


def test_same_token_prerouted_decode_never_loads_on_demand(packs, trained_same_token):
    """Each predicted layer's experts are read while the layer before it computes, so
    none loads on demand, and the routing is the heads' (not native)."""
    from edgemoe.format.pack import Pack

    path = packs["qwen3_moe"]["hf"]
    budget = minimum_bytes(Pack.open(path))
    model, _ = edgemoe.load(path, expert_budget=budget, routing="prerouted",
                            prerouter_path=trained_same_token)
    prompt = mx.array(np.random.default_rng(5).integers(3, 500, 20))
    logits, on_demand = decode_steps(model, prompt)
    assert all(on_demand[l] == 0 for l in (1, 2, 3)), on_demand
    assert model.expert_store.snapshot().prefetches > 0
    native, _ = edgemoe.load(path, expert_budget=budget)
    native_logits, _ = decode_steps(native, prompt)
    assert not mx.array_equal(logits, native_logits)


def test_a_decode_step_of_next_token_routing_skips_the_routing_sync(packs, trained,
                                                                    monkeypatch):
    """A predicted layer's decode routing is on the host a token early (its next-token
    prediction): the step skips that layer's routing sync, and computes exactly what the step with the sync computes."""
    from edgemoe.format.pack import Pack
    from edgemoe.mlx_backend.driver import PredictedRouting

    folder = trained[0] / "prerouter"
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


def test_stepwise_eval_scores_as_decode_routes(packs, trained):
    """`edgemoe.eval --stepwise` scores a token a call, as decode runs: for native routing
    and next-token heads that is what one call per window scores, their shift being the
    same within a call and from call to call."""
    from edgemoe.eval import compare

    path = packs["qwen3_moe"]["hf"]
    tokens = np.random.default_rng(7).integers(3, 500, 49).tolist()

    def nll(stepwise, **options):
        model, _ = edgemoe.load(path, **options)
        return compare([model], tokens, context=24, stepwise=stepwise)["nll"][0]

    for heads in (None, trained[0] / "prerouter"):
        options = {} if heads is None else {"routing": "prerouted", "prerouter_path": heads}
        assert abs(nll(True, **options) - nll(False, **options)) < 1e-3, options
    other = nll(True, routing="prerouted", prerouter_path=trained[0] / "prerouter")
    assert abs(other - nll(True)) > 1e-3  # (the routing does change the score)
