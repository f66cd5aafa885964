"""The modes between exact and predicted routing (edgemoe.mlx_backend.conditional and
edgemoe.routing.between, issue #52)."""

import json

import mlx.core as mx
import numpy as np
import pytest

import edgemoe
from edgemoe.format.pack import Pack
from edgemoe.format.source import BUNDLED_MODEL
from edgemoe.mlx_backend.experts import streaming_of
from edgemoe.mlx_backend.conditional import (ConditionalTap, SlotSim, install_conditional,
                                             set_top_k)
from edgemoe.routing.between import (layer_recall, plain_heads, route_by_recall,
                                     with_native_layers)
from edgemoe.mlx_backend.gates import moe_blocks
from edgemoe.routing.heads_config import read_config
from edgemoe.streaming.cache import make_policy
from edgemoe.whatif.replay import simulate
from edgemoe.streaming.trace import load_trace

# the shipped default (docs/routing.md, the frontier): heads recalling less keep the router
SHIPPED_MIN_RECALL, SHIPPED_CONDITIONAL = 0.45, 8
TEXT = "def read_lines(path):\n    with open(path) as f:\n        return f.read().split()\n"


@pytest.mark.parametrize("budget, slots", [("10%", 12), ("25%", 32)])
def test_simulated_slots_load_as_the_store_does(budget, slots):
    """SlotSim (what cache-conditional routing measures its bytes with) loads within 1% of
    the store's own replay, on the bundled model's held-out trace."""
    trace = load_trace(BUNDLED_MODEL / "traces" / "stdlib.npz")
    n = len(trace["decode"])
    trace.update(decode=np.ones(n, dtype=bool), calls=np.ones(n, dtype=np.int32))
    store_loads = simulate(trace, budget, "lfu").decode_bytes_read / int(trace["expert_bytes"][0])
    loads = 0
    for layer in range(trace["routed"].shape[1]):
        sim = SlotSim(slots, make_policy("lfu"))
        for ids in trace["routed"][:, layer]:
            sim.step(ids.tolist())
        loads += sim.loads
    assert abs(loads / store_loads - 1) < 0.01


def test_conditional_routing_chooses_the_routers_best_among_slots_and_prediction():
    rng = np.random.default_rng(0)
    tap = ConditionalTap.__new__(ConditionalTap)  # only its choice, no router map
    tap.top_k, tap.predicted, tap.sim, tap.exact, tap.tokens = 4, 4, SlotSim(6, make_policy("lfu")), 0, 0
    native, predicted = rng.normal(size=(64, 32)), rng.normal(size=(64, 32))
    predicted[0] = np.nan  # the first token: no prediction, native
    for row in range(64):
        resident = set(tap.sim.resident)
        mask = tap._mask(native[row:row + 1], predicted[row:row + 1])[0]
        allowed = set(np.flatnonzero(mask == 0).tolist())
        best = set(np.argsort(-native[row])[:4].tolist())
        if row == 0:
            assert allowed == set(range(32))
            continue
        ahead = set(np.argsort(-predicted[row])[:4].tolist())
        assert allowed == resident | ahead
        chosen = set(sorted(allowed, key=lambda e: -native[row, e])[:4])
        assert chosen <= allowed and (chosen == best) == (best <= allowed)
    assert 0 < tap.exact < tap.tokens == 64


def test_conditional_routing_with_every_expert_in_slots_is_native():
    """Exact whenever the router's top-k is available: with every expert in slots, the
    logits are native's bit for bit."""
    native, tokenizer = edgemoe.load(expert_budget=1.0)
    model, _ = edgemoe.load(expert_budget=1.0, routing="prerouted", prerouter_path="pack",
                            adapter_path="none")  # (the routing alone: not the heads' adapter)
    blocks = moe_blocks(model)
    taps = install_conditional(streaming_of(model).routing.predictor, blocks, slots=128,
                               predicted=8, new_policy=lambda: make_policy("lfu"))
    for tap in taps.values():
        tap.sim.step(list(range(128)))
    tokens = mx.array([tokenizer.encode(TEXT)])
    assert mx.array_equal(model(tokens), native(tokens)).item()
    assert all(t.exact == t.tokens > 0 for t in taps.values())


def test_fewer_slots_route_otherwise_and_reduced_top_k_routes_k():
    native, tokenizer = edgemoe.load(expert_budget=1.0)
    model, _ = edgemoe.load(expert_budget=1.0, routing="prerouted", prerouter_path="pack",
                            adapter_path="none")  # (the routing alone: not the heads' adapter)
    blocks = moe_blocks(model)
    taps = install_conditional(streaming_of(model).routing.predictor, blocks, slots=8,
                               predicted=8, new_policy=lambda: make_policy("lfu"))
    tokens = mx.array([tokenizer.encode(TEXT)])
    assert not mx.array_equal(model(tokens), native(tokens)).item()
    assert all(t.exact < t.tokens for t in taps.values())
    store = streaming_of(native).store
    recorder = store.start_trace()
    set_top_k(moe_blocks(native).values(), 4)
    native(tokens)
    assert recorder.as_trace()["routed"].shape[-1] == 4


def test_native_layers_copy_keeps_those_layers_on_their_router(tmp_path):
    plain = plain_heads(BUNDLED_MODEL / "prerouter", tmp_path / "plain")
    assert read_config(plain).native_layers == [0] and read_config(plain).plain
    out = with_native_layers(plain, [1, 2], tmp_path / "heads")
    config = read_config(out)
    assert config.native_layers == [0, 1, 2]
    assert config.predicted_layers == [3, 4, 5, 6, 7]


def test_the_shipped_routing_keeps_the_layers_whose_heads_recall_least(tmp_path):
    """The pack's default of --routing prerouted (its heads' config) is what
    route_by_recall writes from the heads' training report: the layers below
    SHIPPED_MIN_RECALL keep their router, the others route cache-conditionally."""
    shipped = json.loads((BUNDLED_MODEL / "prerouter" / "prerouter_config.json").read_text())
    copy = with_native_layers(BUNDLED_MODEL / "prerouter", [], tmp_path / "heads")
    assert route_by_recall(copy, SHIPPED_MIN_RECALL, SHIPPED_CONDITIONAL) == shipped
    recall = layer_recall(BUNDLED_MODEL / "prerouter" / "report.json")
    assert all(recall[t] < SHIPPED_MIN_RECALL for t in shipped["native_layers"][1:])
    assert 0 < len(shipped["native_layers"]) < 8 and shipped["conditional"] == 8
    # and its own adapter: the pack's attention LoRA on every layer, no expert deltas (the
    # frontier's fallback-0-4-conditional-8+adapter-attn, docs/routing.md)
    own = mx.load(str(BUNDLED_MODEL / "prerouter" / shipped["adapter"] / "adapters.safetensors"))
    full = mx.load(str(BUNDLED_MODEL / "adapter" / "adapters.safetensors"))
    assert set(own) == {k for k in full if "switch_mlp" not in k}
    assert {int(k.split(".")[2]) for k in own} == set(range(8))


@pytest.fixture(scope="module")
def conditional_heads(tmp_path_factory):
    """The shipped heads set to route cache-conditionally among their 8 most likely and
    the slots, 4 experts a token (the modes' fields of prerouter_config.json)."""
    out = with_native_layers(BUNDLED_MODEL / "prerouter", [],
                             tmp_path_factory.mktemp("conditional") / "heads")
    config = json.loads((out / "prerouter_config.json").read_text())
    config.update(conditional=8, route_top_k=4)
    (out / "prerouter_config.json").write_text(json.dumps(config))
    return out


def test_the_shipped_routing_runs_through_generate_eval_and_the_server():
    """The pack's default of --routing prerouted (per-layer fallback and cache-conditional
    routing) with no --prerouter: in generate, eval and the server."""
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from test_server import completion, running_server

    from edgemoe.eval import ModelConfig, evaluate

    shipped = read_config(BUNDLED_MODEL / "prerouter")
    model, tokenizer = edgemoe.load(expert_budget="25%", routing="prerouted")
    taps = streaming_of(model).routing.predictor.taps
    assert sorted(taps) == shipped.predicted_layers  # the others keep their router
    from edgemoe.mlx_backend.lora import lora_layers
    adapted = {int(n.split(".")[2]) for n, m in lora_layers(model).items()
               if mx.any(m.lora_b != 0).item()}
    assert adapted == set(range(8))  # the heads' own adapter, loaded with them
    assert streaming_of(model).store.pack.expert_bytes == \
        Pack.open(BUNDLED_MODEL).expert_bytes  # attention only: no deltas ride along
    assert all(isinstance(t, ConditionalTap) and t.sim.slots == 32 for t in taps.values())
    prompt = tokenizer.encode(TEXT)
    tokens = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6,
                                               sampler=make_sampler(0.0))]
    assert len(tokens) == 6 and all(t.tokens > 0 for t in taps.values())
    config = ModelConfig.parse(f"{BUNDLED_MODEL},budget=0.25,routing=prerouted")
    result = evaluate([config], TEXT * 4, context=32, max_tokens=64)
    assert 1 < result["configs"][0]["perplexity"] < 1e4
    with running_server("--expert-budget", "25%", "--routing", "prerouted") as url:
        ids, _, text, finish = completion(url, TEXT, max_tokens=6)
    # the agent stage's model may end its text (token 0) before 6 tokens
    assert len(ids) == 6 or (finish == "stop" and 1 <= len(ids) < 6), (ids, finish)


def test_reduced_top_k_heads_route_k_experts(conditional_heads):
    model, _ = edgemoe.load(expert_budget="25%", routing="prerouted",
                            prerouter_path=str(conditional_heads))
    assert all(b.top_k == 4 for b in moe_blocks(model).values())


def test_other_backends_refuse_heads_of_a_mode_they_do_not_run(conditional_heads):
    torch = pytest.importorskip("torch")  # noqa: F841
    from edgemoe.cuda.prerouted import load_heads

    with pytest.raises(ValueError, match="conditional 8"):
        load_heads(conditional_heads, "cpu")


def test_adapter_subset_keeps_the_layers_and_leaves_the_experts_out(tmp_path):
    """adapter_subset (the heads' own adapter, and the frontier's adapter rows) copies
    the chosen layers' tensors bit for bit; attention-only leaves every routed expert's
    delta out, and their keys from the config (no delta records to stream)."""
    from edgemoe.format.adapters import adapter_subset

    pack = BUNDLED_MODEL / "adapter"
    full = mx.load(str(pack / "adapters.safetensors"))
    out = adapter_subset(pack, tmp_path / "a", [5, 7], attention_only=True)
    part = mx.load(str(out / "adapters.safetensors"))
    assert part and {int(k.split(".")[2]) for k in part} == {5, 7}
    assert not any("switch_mlp" in k for k in part)
    assert {k for k in full if int(k.split(".")[2]) in (5, 7) and "switch_mlp" not in k} \
        == set(part)
    assert all(mx.array_equal(part[k], full[k]).item() and part[k].dtype == full[k].dtype
               for k in part)
    keys = json.loads((out / "adapter_config.json").read_text())["lora_parameters"]["keys"]
    assert keys and all(k.startswith("self_attn.") for k in keys)
    with_experts = mx.load(str(adapter_subset(pack, tmp_path / "b", [6])
                               / "adapters.safetensors"))
    assert any("switch_mlp" in k for k in with_experts)
    with pytest.raises(ValueError, match="no tensor of layers"):
        adapter_subset(pack, tmp_path / "c", [99])


def test_heads_carry_their_adapter_unless_another_is_given(tmp_path):
    """`between --adapter` writes the adapter measured with the heads' routing into their
    folder and names it in their config: loading those heads loads it (its layers'
    deltas, the others' zero); an adapter given explicitly wins, "none" loads none; a
    plain copy drops it;
    a config naming a folder that is not there is refused, naming the field."""
    from edgemoe.mlx_backend.lora import lora_layers
    from edgemoe.routing.between import main as between

    heads = with_native_layers(BUNDLED_MODEL / "prerouter", [], tmp_path / "heads")
    config = json.loads((heads / "prerouter_config.json").read_text())
    config.update(native_layers=[0, 1, 2, 3, 4, 5], conditional=8, adapter="")
    (heads / "prerouter_config.json").write_text(json.dumps(config))
    between(["--heads", str(heads), "--adapter", str(BUNDLED_MODEL / "adapter"),
             "--attention-only"])
    assert read_config(heads).adapter == "adapter"
    full = mx.load(str(BUNDLED_MODEL / "adapter" / "adapters.safetensors"))

    def adapted(model):  # the decoder layers whose q_proj carries a nonzero delta
        return {int(n.split(".")[2]) for n, m in lora_layers(model).items()
                if n.endswith("self_attn.q_proj") and mx.any(m.lora_b != 0).item()}

    model, _ = edgemoe.load(expert_budget="25%", routing="prerouted", prerouter_path=str(heads))
    assert adapted(model) == {6, 7}  # the predicted layers
    q = lora_layers(model)["model.layers.6.self_attn.q_proj"]
    assert mx.array_equal(q.lora_b, full["model.layers.6.self_attn.q_proj.lora_b"]).item()
    model, _ = edgemoe.load(expert_budget="25%", routing="prerouted", prerouter_path=str(heads),
                            adapter_path="pack")
    assert adapted(model) == set(range(8))
    model, _ = edgemoe.load(expert_budget="25%", routing="prerouted", prerouter_path=str(heads),
                            adapter_path="none")
    assert adapted(model) == set()
    plain = plain_heads(heads, tmp_path / "plain")
    assert read_config(plain).adapter == "" and not (plain / "adapter").exists()
    model, _ = edgemoe.load(expert_budget="25%", routing="prerouted", prerouter_path=str(plain))
    assert adapted(model) == set()
    config["adapter"] = "missing"
    (heads / "prerouter_config.json").write_text(json.dumps(config))
    with pytest.raises(FileNotFoundError, match="adapter 'missing'"):
        edgemoe.load(expert_budget="25%", routing="prerouted", prerouter_path=str(heads))


def test_frontier_counts_the_delta_bytes_of_the_adapter_it_loads(tmp_path):
    """frontier.py's bytes a token count the expert deltas of the adapter a row loads (a
    retrained adapter of another rank: half the rank, half the delta bytes), not the pack's."""
    import frontier

    pack = BUNDLED_MODEL / "adapter"
    full = mx.load(str(pack / "adapters.safetensors"))
    half = {k: (v[:, :2] if k.endswith("lora_a") else v[..., :2]) if "switch_mlp" in k
            else (v[:, :2] if k.endswith("lora_a") else v[:2]) for k, v in full.items()}
    (tmp_path / "r2").mkdir()
    mx.save_safetensors(str(tmp_path / "r2" / "adapters.safetensors"), half)
    config = json.loads((pack / "adapter_config.json").read_text())
    config["lora_parameters"]["rank"] = 2
    (tmp_path / "r2" / "adapter_config.json").write_text(json.dumps(config))
    shipped = frontier.delta_share(pack) - 1
    assert shipped > 0
    assert frontier.delta_share(tmp_path / "r2") - 1 == pytest.approx(shipped / 2, rel=0.05)
    row = {"adapter_path": str(tmp_path / "r2"), "adapter": [5, 6, 7]}
    assert frontier.adapter_of(row) == tmp_path / "r2"
    assert frontier.adapter_of({"adapter": True}) == pack


def test_the_frontiers_json_names_paths_in_the_repository_relative_to_it():
    """docs/frontier*.json are committed: a path of this checkout means nothing to a user."""
    import frontier

    root = frontier.ROOT
    assert frontier.shown(root / "edgemoe/models/fine/prerouter") == "edgemoe/models/fine/prerouter"
    assert frontier.adapter_of({"adapter_path": "edgemoe/models/fine/adapter"}) == \
        root / "edgemoe/models/fine/adapter"
    docs = root / "docs"
    for name in ("frontier.json", "frontier-first-stage.json"):
        result = json.loads((docs / name).read_text())
        paths = [result["heads"]] + [c["spec"]["adapter_path"] for c in result["configs"]
                                     if "adapter_path" in c["spec"]]
        assert not any(p.startswith("/") for p in paths), (name, paths)
