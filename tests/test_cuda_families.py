"""The CUDA backend, on the CPU, runs every MoE family that transformers builds and mlx-lm
reads from a Hugging Face checkpoint (make_hf_family_checkpoints.HF_FAMILIES): a pack
converted from the family's tiny transformers checkpoint decodes greedily to the MLX
path's tokens, fp32 logits within 1e-3 of its, at the minimum expert budget (evicting),
natively and in the prerouted modes (with untrained heads of the MLX path's making);
advisory routing prefetches and leaves native's logits bit for bit; what it cannot run is
refused in one line naming the model_type and why (edgemoe/cuda/families.py).
"""

import json

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the CUDA backend needs PyTorch (edgemoe[cuda])")
pytest.importorskip("transformers", reason="the CUDA backend needs transformers")

import edgemoe  # noqa: E402
import gpu_check  # noqa: E402  (scripts/, on the path through conftest)
from edgemoe.convert import convert  # noqa: E402
from edgemoe.cuda import families  # noqa: E402
from edgemoe.cuda.model import greedy, load  # noqa: E402
from edgemoe.cuda.prerouted import MODES  # noqa: E402
from edgemoe.format.pack import Pack, PackError  # noqa: E402
from edgemoe.mlx_backend.gates import hidden_size, moe_blocks  # noqa: E402
from edgemoe.mlx_backend.prerouter import Prerouter, config_for_model, save_prerouter  # noqa: E402
from edgemoe.streaming.budget import minimum_bytes  # noqa: E402
from make_hf_family_checkpoints import HF_FAMILIES, make_hf_family  # noqa: E402

LOGIT_TOLERANCE = 1e-3
PROMPT_LEN, DECODE = 16, 4
UNGROUPED = {"n_group": 1, "topk_group": 1}  # afmoe: transformers' router ignores groups
HEADS_SCALE = 8.0  # untrained heads' logits, scaled: see untrained_heads


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


class FamilyPack:
    """A family's pack, its minimum budget and its prompt."""

    def __init__(self, pack):
        self.path = str(pack)
        self.config = json.loads((pack / "config.json").read_text())
        self.budget = minimum_bytes(Pack.open(self.path))
        self.prompt = prompt(self.config)

    def run(self, gated=True, **options):
        """The CUDA backend's greedy decode on the CPU, and its store's counters; `gated`
        False reads every prediction ahead (advisory gates them by their precision)."""
        model, _ = load(self.path, expert_budget=self.budget, device="cpu", tokenizer=False, **options)
        if not gated:
            model.expert_store.gate_prefetches(False)
        run, stats = greedy(model, self.prompt, DECODE), model.expert_store.snapshot()
        model.expert_store.close()
        return run, stats

    def mlx_run(self, **options):
        model, _ = edgemoe.load(self.path, expert_budget=self.budget, **options)
        tokens, logits = gpu_check.mlx_greedy(model, self.prompt, DECODE)
        model.expert_store.close()
        return tokens, logits


@pytest.fixture(scope="module")
def family(packs):
    return lambda name: FamilyPack(packs[name])


@pytest.fixture(scope="module")
def native_runs(family):
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = family(name).run()
        return runs[name]

    return get


def test_every_candidate_family_has_its_entry():
    assert sorted(families.SUPPORTED_MODEL_TYPES) == sorted(HF_FAMILIES)
    assert not set(families.UNSUPPORTED) & set(families.SUPPORTED_MODEL_TYPES)


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_family_decodes_as_the_mlx_path(name, family, native_runs):
    ref_tokens, ref_logits = family(name).mlx_run()
    run, stats = native_runs(name)
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert stats.evictions > 0


@pytest.mark.parametrize("name", HF_FAMILIES)
def test_family_advisory_routing_prefetches_and_stays_native(name, family, native_runs):
    native, _ = native_runs(name)
    run, stats = family(name).run(routing="advisory", gated=False)
    assert run.tokens == native.tokens and torch.equal(run.logits, native.logits)
    assert stats.prefetches > 0


def untrained_heads(fam: FamilyPack, out):
    """Prerouter heads as the MLX path makes them (edgemoe.train_prerouter), untrained:
    parity needs no good heads. Their logits are scaled up so that they route away from
    native even where a tiny model's routing is all its score biases (deepseek_v32)."""
    model, _ = edgemoe.load(fam.path, expert_budget=fam.budget)
    blocks = moe_blocks(model)
    model.expert_store.close()
    mx.random.seed(0)
    heads = Prerouter(config_for_model(fam.config["model_type"],
                                       hidden_size(blocks[min(blocks)]), blocks))
    for head in heads.heads.values():
        head.down.weight = head.down.weight * HEADS_SCALE
        head.down.bias = head.down.bias * HEADS_SCALE
    return save_prerouter(heads, out)


@pytest.fixture(scope="module")
def heads(family, tmp_path_factory):
    out, made = tmp_path_factory.mktemp("cuda_family_heads"), {}

    def get(name):
        if name not in made:
            made[name] = untrained_heads(family(name), out / name)
        return made[name]

    return get


@pytest.mark.parametrize("routing", MODES)
@pytest.mark.parametrize("name", HF_FAMILIES)
def test_family_prerouted_as_the_mlx_path(name, routing, family, heads, native_runs):
    fam = family(name)
    ref_tokens, ref_logits = fam.mlx_run(routing=routing, prerouter_path=heads(name))
    run, stats = fam.run(routing=routing, prerouter_path=heads(name))
    native, _ = native_runs(name)
    assert run.tokens == ref_tokens
    assert np.abs(run.logits.numpy() - ref_logits).max() < LOGIT_TOLERANCE
    assert (run.logits - native.logits).abs().max() > 5 * LOGIT_TOLERANCE, "native routing"
    assert stats.prefetches > 0


def one_line_refusal(path) -> str:
    with pytest.raises(PackError) as refused:
        load(path, expert_budget=1.0, device="cpu", tokenizer=False)
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
