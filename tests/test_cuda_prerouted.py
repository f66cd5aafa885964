"""Prerouted routing on the CUDA backend (CPU mode, float32) against the MLX path's.

The bundled model with the heads its pack carries: the same greedy tokens as
edgemoe.load(..., routing="prerouted"), logits within the backend's tolerance, logits
that are not native's (so a backend that ignored the heads would fail), prefetches that
save on-demand loads, and routing state that belongs to the sequence; a router that
cannot route by given logits is refused in one line. (Every family's parity with the MLX
path's prerouted modes: tests/test_cuda_families.py.)
"""

import json
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

import edgemoe  # noqa: E402
from edgemoe.cuda import families  # noqa: E402
from edgemoe.cuda.model import DEFAULT_MODEL, _cache_argument, greedy, load  # noqa: E402
from edgemoe.cuda.prerouted import CONFIG, returned_cache  # noqa: E402
from edgemoe.format.families import UnsupportedModelError  # noqa: E402
from edgemoe.format.pack import Pack  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402
from torch import nn  # noqa: E402
from transformers import DynamicCache  # noqa: E402
from transformers.models.qwen3_moe import modeling_qwen3_moe  # noqa: E402

import gpu_check  # noqa: E402  (scripts/, on the path through conftest)

LOGIT_TOLERANCE = 1e-3  # as tests/test_cuda_backend.py: fp32 differs by ~1e-5
PROMPT_LEN, DECODE = 48, 16
PATH = str(DEFAULT_MODEL)
HEADS = DEFAULT_MODEL / "prerouter"


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """The pack's heads routing every layer but the first (the shipped default's
    cache-conditional routing is the MLX backend's, which this backend refuses)."""
    from edgemoe.routing.between import plain_heads

    return plain_heads(HEADS, tmp_path_factory.mktemp("heads") / "plain")


def prompt(seed=7):
    return np.random.default_rng(seed).integers(3, 500, PROMPT_LEN).tolist()


def amount(budget):
    return minimum_bytes(Pack.open(PATH)) if budget == "minimum" else 0.25


@pytest.fixture(scope="module")
def mlx_runs(heads):
    cache = {}

    def get(routing, budget):
        if (routing, budget) not in cache:
            model, _ = edgemoe.load(PATH, expert_budget=amount(budget), routing=routing,
                                    prerouter_path=heads)
            cache[routing, budget] = gpu_check.mlx_greedy(model, prompt(), DECODE)
            model.expert_store.close()
        return cache[routing, budget]

    return get


@pytest.fixture(scope="module")
def native_runs():
    cache = {}

    def get(budget):
        if budget not in cache:
            model, _ = load(PATH, expert_budget=amount(budget), device="cpu", tokenizer=False)
            cache[budget] = greedy(model, prompt(), DECODE), model.expert_store.snapshot()
            model.expert_store.close()
        return cache[budget]

    return get


@pytest.mark.parametrize("routing, budget", [("prerouted", "minimum"), ("prerouted", "25%")])
def test_prerouted_matches_the_mlx_path(routing, budget, mlx_runs, native_runs, heads):
    ref_tokens, ref_logits = mlx_runs(routing, budget)
    native, native_stats = native_runs(budget)
    model, _ = load(PATH, expert_budget=amount(budget), device="cpu", tokenizer=False,
                    routing=routing, prerouter_path=heads)
    run = greedy(model, prompt(), DECODE)
    stats = model.expert_store.snapshot()
    again = greedy(model, prompt(), DECODE)  # a new sequence: nothing carried over
    model.expert_store.close()
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert np.abs(run.logits.numpy() - native.logits.numpy()).max() > 0.1, "native routing"
    assert again.tokens == run.tokens and torch.equal(again.logits, run.logits)
    assert native_stats.prefetches == 0 < stats.prefetches
    assert stats.on_demand < native_stats.on_demand


def test_each_sequence_carries_its_own_routing(heads):
    """Two sequences decoded in turns, one whose cache the first call made (no cache given),
    one with a cache of its own: each gets its solo decode's logits."""
    model, _ = load(PATH, expert_budget=0.25, device="cpu", tokenizer=False, routing="prerouted",
                    prerouter_path=heads)
    prompts, steps = (prompt(7), prompt(8)), 4
    solo = [greedy(model, p, steps) for p in prompts]
    arg = _cache_argument(model)
    with torch.inference_mode():
        first = model(input_ids=torch.tensor([prompts[0]]), use_cache=True)
        caches = [returned_cache(first), DynamicCache()]
        outs = [[first.logits[0]], [model(input_ids=torch.tensor([prompts[1]]), use_cache=True,
                                          **{arg: caches[1]}).logits[0]]]
        for i in range(steps):
            for s in (0, 1):
                token = torch.tensor([[solo[s].tokens[i]]])
                outs[s].append(model(input_ids=token, use_cache=True, **{arg: caches[s]}).logits[0])
    model.expert_store.close()
    for s in (0, 1):
        assert torch.equal(torch.cat(outs[s]).float(), solo[s].logits), f"sequence {s}"


def same_token_heads(folder, heads):
    """The pack's next-token heads read as same-token heads (parity needs no good heads)."""
    shutil.copytree(heads, folder)
    config = json.loads((folder / CONFIG).read_text())
    (folder / CONFIG).write_text(json.dumps({**config, "same_token": True}))
    return folder


def test_same_token_heads_route_as_the_mlx_path(tmp_path, heads):
    """Same-token heads route each call by their prediction for its own positions and read
    those experts a layer ahead: the MLX path's tokens and logits."""
    heads, routing = same_token_heads(tmp_path / "same-token", heads), "prerouted"
    budget = amount("minimum")
    mlx_model, _ = edgemoe.load(PATH, expert_budget=budget, routing=routing,
                                prerouter_path=heads)
    ref_tokens, ref_logits = gpu_check.mlx_greedy(mlx_model, prompt(), DECODE)
    mlx_model.expert_store.close()
    model, _ = load(PATH, expert_budget=budget, device="cpu", tokenizer=False, routing=routing,
                    prerouter_path=heads)
    run = greedy(model, prompt(), DECODE)
    stats = model.expert_store.snapshot()
    model.expert_store.close()
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert stats.prefetches > 0 and stats.predicted_used > 0


def test_routing_errors_are_one_line(tmp_path):
    cases = [(dict(routing="psychic"), ValueError, "choose one of native, advisory, prerouted"),
             (dict(routing="prerouted", prerouter_path=tmp_path / "none"), FileNotFoundError,
              f"{tmp_path / 'none' / CONFIG}: no such file"),
             (dict(routing="advisory", prerouter_path=HEADS), ValueError,
              "advisory routing prefetches by the next layer's router")]
    for kwargs, error, message in cases:
        with pytest.raises(error) as e:
            load(PATH, expert_budget=0.25, device="cpu", tokenizer=False, **kwargs)
        assert message in str(e.value) and "\n" not in str(e.value), kwargs


def refused(heads, routing="prerouted") -> str:
    with pytest.raises(UnsupportedModelError) as e:
        load(PATH, expert_budget=0.25, device="cpu", tokenizer=False, routing=routing,
             prerouter_path=heads)
    message = str(e.value)
    assert "\n" not in message and f"{DEFAULT_MODEL / 'config.json'}: model_type 'qwen3_moe': " \
        "prerouted routing " in message, message
    return message


def test_a_router_it_cannot_route_by_given_logits_is_refused(monkeypatch, heads):
    """Prerouted routing runs each router on the chosen logits: a router whose routing
    depends on more than its logits, or whose logits' map it cannot find, is refused."""
    router = modeling_qwen3_moe.Qwen3MoeTopKRouter
    forward = router.forward

    def weighed_by_its_input(self, hidden_states):
        logits, weights, ids = forward(self, hidden_states)
        return logits, weights * hidden_states.abs().mean(-1, keepdim=True), ids

    monkeypatch.setattr(router, "forward", weighed_by_its_input)
    assert "Qwen3MoeTopKRouter's routing of its own logits differs from its routing of " \
           "its input" in refused(heads)
    monkeypatch.undo()
    monkeypatch.setattr(families, "router", lambda block: nn.Sequential())  # no linear map
    assert "Sequential has neither a 2-D `weight` nor one Linear inside it" in refused(heads)
