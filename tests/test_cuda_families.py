"""The CUDA backend, on the CPU, runs every MoE family that transformers builds and mlx-lm
reads from a Hugging Face checkpoint (make_hf_family_checkpoints.HF_FAMILIES): a pack
converted from the family's tiny transformers checkpoint decodes greedily to the MLX
path's tokens, fp32 logits within 1e-3 of its, at the minimum expert budget (evicting);
what it cannot run is refused in one line naming the model_type and why
(edgemoe/cuda/families.py).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

import edgemoe  # noqa: E402
import gpu_check  # noqa: E402  (scripts/, on the path through conftest)
from edgemoe.convert import convert  # noqa: E402
from edgemoe.cuda import families  # noqa: E402
from edgemoe.cuda.model import greedy, load  # noqa: E402
from edgemoe.format.pack import Pack, PackError  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402
from make_hf_family_checkpoints import HF_FAMILIES, make_hf_family  # noqa: E402

LOGIT_TOLERANCE = 1e-3
PROMPT_LEN, DECODE = 16, 4
UNGROUPED = {"n_group": 1, "topk_group": 1}  # afmoe: transformers' router ignores groups


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    """family -> its pack; "afmoe-grouped" is afmoe as the family config has it."""
    out = tmp_path_factory.mktemp("cuda_families")
    result = {}
    for family in HF_FAMILIES:
        checkpoint = make_hf_family(family, out / f"{family}-hf")
        if family == "afmoe":
            result["afmoe-grouped"] = convert(checkpoint, out / "afmoe-grouped-pack")
            config = json.loads((checkpoint / "config.json").read_text())
            (checkpoint / "config.json").write_text(json.dumps({**config, **UNGROUPED}))
        result[family] = convert(checkpoint, out / f"{family}-pack")
    return result


def prompt(config: dict):
    """A random prompt; DeepSeek sparse attention's families stay within index_topk, past
    which torch and MLX break the indexer's ties differently (families.py)."""
    length = min(PROMPT_LEN, config.get("index_topk", PROMPT_LEN + DECODE) - DECODE)
    return np.random.default_rng(7).integers(3, 500, length).tolist()


def test_every_candidate_family_has_its_entry():
    assert sorted(families.SUPPORTED_MODEL_TYPES) == sorted(HF_FAMILIES)
    assert not set(families.UNSUPPORTED) & set(families.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_family_decodes_as_the_mlx_path(family, packs):
    path = str(packs[family])
    budget = minimum_bytes(Pack.open(path))
    tokens = prompt(json.loads((packs[family] / "config.json").read_text()))
    mlx_model, _ = edgemoe.load(path, expert_budget=budget)
    ref_tokens, ref_logits = gpu_check.mlx_greedy(mlx_model, tokens, DECODE)
    mlx_model.expert_store.close()
    model, _ = load(path, budget, device="cpu", tokenizer=False)
    run = greedy(model, tokens, DECODE)
    evictions = model.expert_store.stats.evictions
    model.expert_store.close()
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert evictions > 0


def one_line_refusal(path) -> str:
    with pytest.raises(PackError) as refused:
        load(path, 1.0, device="cpu", tokenizer=False)
    message = str(refused.value)
    assert "\n" not in message and "config.json: model_type " in message, message
    return message


def test_grouped_afmoe_is_refused_with_its_reason(packs):
    message = one_line_refusal(packs["afmoe-grouped"])
    assert "'afmoe'" in message and "n_group" in message and "AfmoeTokenChoiceRouter" in message


@pytest.mark.parametrize("model_type", ["gpt_oss", "qwen3_5_moe", "not_a_family"])
def test_other_families_are_refused_with_their_reason(model_type, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    message = one_line_refusal(tmp_path)
    reason = families.UNSUPPORTED.get(model_type, "the CUDA backend runs afmoe")
    assert f"'{model_type}': {reason}" in message
