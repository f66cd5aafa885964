"""The bundled models stream bit-identical to mlx-lm: the pack, and the mlx-lm checkpoint it
unpacks to read in place, at a quarter of the experts and at the minimum budget, on real text."""

import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.format.pack import Pack
from edgemoe.streaming.budget import minimum_bytes

from unpack import unpack

MODELS = Path(edgemoe.__file__).resolve().parent / "models"
BUNDLED = [p.name for p in sorted(MODELS.iterdir()) if (p / "manifest.json").exists()]
PROMPT, FORCED = 64, 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            folder = unpack(MODELS / name, tmp_path_factory.mktemp(name))
            model, tokenizer = mlx_lm_load(str(folder))
            text = (Path(sysconfig.get_paths()["stdlib"]) / "json" / "decoder.py").read_text()
            tokens = mx.array(tokenizer.encode(text)[:PROMPT + FORCED])
            cache[name] = folder, tokens, logits(model, tokens)
        return cache[name]
    return get


def logits(model, tokens):
    """The prompt's logits, then each forced token's, decoded one at a time."""
    cache = make_prompt_cache(model)
    out = [model(tokens[None, :PROMPT], cache=cache)[0]]
    out += [model(t.reshape(1, 1), cache=cache)[0] for t in tokens[PROMPT:]]
    return mx.concatenate(out)


@pytest.mark.parametrize("budget", ["25%", "minimum"])
@pytest.mark.parametrize("where", ["pack", "in place"])
@pytest.mark.parametrize("name", BUNDLED)
def test_bundled_models_give_mlx_lms_logits_bit_for_bit(name, where, budget, checkpoints):
    folder, tokens, expected = checkpoints(name)
    path = MODELS / name if where == "pack" else folder
    if budget == "minimum":
        budget = minimum_bytes(Pack.open(MODELS / name))
    model, _ = edgemoe.load(path, expert_budget=budget)
    found = logits(model, tokens)
    store = model.expert_store
    assert store.info().slots_per_layer < Pack.open(MODELS / name).layers[0].num_experts
    assert store.snapshot().bytes_read > 0  # experts were streamed, not all resident
    assert mx.array_equal(found, expected).item()
