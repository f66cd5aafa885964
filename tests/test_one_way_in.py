"""One way in and one way through: the MLX and CUDA `load` take the same options, and a
routing mode is an object the tools ask, never a string they compare (issue 44)."""

import ast
import inspect
from dataclasses import fields
from pathlib import Path

import pytest

import edgemoe
from edgemoe.options import StreamOptions
from edgemoe.routing.modes import ADVISORY, MODE_NAMES, NATIVE, PREROUTED, routing_mode
from edgemoe.mlx_backend.predictors import predictor_for

MLX_LM_KEYWORDS = {"tokenizer_config", "model_config", "lazy", "return_config"}


def shared_part(load) -> list:
    """The parameters every backend's load has: all but its keyword-only extras."""
    return [p for p in inspect.signature(load).parameters.values()
            if p.kind is not inspect.Parameter.KEYWORD_ONLY]


def own_part(load) -> set:
    return {p.name for p in inspect.signature(load).parameters.values()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def test_the_mlx_and_cuda_load_share_one_signature():
    pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
    pytest.importorskip("transformers", reason="the CUDA backend needs transformers")
    from edgemoe.cuda.model import load as cuda_load

    assert shared_part(edgemoe.load) == shared_part(cuda_load)
    names = [p.name for p in shared_part(edgemoe.load)]
    assert names == ["path_or_hf_repo", "options", "overrides"]
    options = {f.name for f in fields(StreamOptions)}
    assert {"expert_budget", "routing", "prerouter_path", "adapter_path"} <= options
    assert not own_part(edgemoe.load) & options and not own_part(cuda_load) & options
    assert MLX_LM_KEYWORDS <= own_part(edgemoe.load)  # mlx-lm's, and adapter_path above
    assert {"device", "dtype", "streams", "kernel", "host_budget"} <= own_part(cuda_load)


def test_a_routing_mode_knows_what_it_needs_and_allows():
    assert [routing_mode(name) for name in MODE_NAMES] == [NATIVE, ADVISORY, PREROUTED]
    assert routing_mode(PREROUTED) is PREROUTED and str(PREROUTED) == "prerouted"
    assert [m.exact for m in (NATIVE, ADVISORY, PREROUTED)] == [True, True, False]
    assert [m.needs_heads for m in (NATIVE, ADVISORY, PREROUTED)] == [False, False, True]
    assert ADVISORY.gates_prefetches and not PREROUTED.gates_prefetches
    assert NATIVE.allows_drafts and not PREROUTED.allows_drafts
    assert ADVISORY.allows_prompt_cache and not PREROUTED.allows_prompt_cache
    assert predictor_for(NATIVE, None, {}) is None  # (the MLX backend's: native is neither)
    with pytest.raises(ValueError, match="advisory routing prefetches by the next layer"):
        ADVISORY.check_heads("HEADS")
    NATIVE.check_heads("HEADS")  # (native ignores them)
    for removed in ("sideways", "prerouted-set", "advisory-heads"):
        with pytest.raises(ValueError, match="choose one of native, advisory, prerouted$"):
            routing_mode(removed)


def _mode_literal(node) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value in MODE_NAMES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_mode_literal(e) for e in node.elts)
    return False


def test_no_module_outside_routing_compares_a_routing_mode_to_a_string():
    """`routing == "advisory"`, `mode in ("prerouted", ...)`, `routing.startswith(
    "prerouted")`: outside edgemoe.routing a mode is asked (`.exact`, `.needs_heads`)."""
    package = Path(edgemoe.__file__).parent
    offenders = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] in ("routing", "models"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                found = any(_mode_literal(n) for n in [node.left, *node.comparators])
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                found = node.func.attr in ("startswith", "endswith") and any(
                    _mode_literal(a) for a in node.args)
            else:
                continue
            if found:
                offenders.append(f"{path.relative_to(package)}:{node.lineno}")
    assert offenders == []


def test_the_cuda_auto_budget_counts_the_resident_weights_as_the_device_holds_them():
    torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch")
    pytest.importorskip("transformers", reason="the CUDA backend needs transformers")
    import json

    from edgemoe.cuda.model import _resident_bytes, load as cuda_load
    from edgemoe.format.source import model_path, open_source

    model, _ = cuda_load(None, device="cpu", tokenizer=False)  # expert_budget="auto"
    path = model_path(None)
    skip = tuple(f"{layer.module}." for layer in open_source(path).layers)
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    config = json.loads((path / "config.json").read_text())
    assert _resident_bytes(path, config, torch.float32, skip) == held  # dequantized
    assert model.expert_store.budget_bytes > 0
    model.expert_store.close()


def test_one_load_plan_asks_the_backend_in_one_order(capsys):
    """Both backends build over the plan `plan_load` resolves: the backend is asked its
    checks once the heads and adapter are found, then its share, its memory for an auto
    budget and its slot memory; the plan's store is open over that memory."""
    from edgemoe.load_plan import Backend, plan_load
    from edgemoe.mlx_backend.slots import MLXSlotMemory

    asked = []

    class Recording(Backend):
        def check(self, plan):
            asked.append(("check", plan.heads is not None, plan.adapter is not None,
                          plan.deltas, plan.store))

        def share(self, plan):
            asked.append("share")
            return super().share(plan)

        def memory_bytes(self):
            asked.append("memory")
            return 2**40

        def slot_memory(self, plan):
            asked.append(("slots", plan.budget))
            return MLXSlotMemory

    options = StreamOptions(routing="prerouted", prerouter_path="pack", adapter_path="pack")
    plan = plan_load(None, options, Recording())
    try:
        assert asked == [("check", True, True, None, None), "share", "memory",
                         ("slots", plan.source.expert_bytes)]  # all of them fit in 1 TiB
        assert plan.store.budget_bytes >= plan.source.expert_bytes and plan.share is None
        assert plan.deltas is not None and plan.source is not plan.opened  # deltas beside
    finally:
        plan.store.close()
