"""Speculative decoding with a streamed target: a draft model through mlx-lm's own loop,
and prompt lookup through ours; greedy output exactly the target's."""

import importlib

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm.generate import generate_step, speculative_generate_step

import edgemoe
from edgemoe.format.source import open_source
from edgemoe.model.generation import generate
from edgemoe.model.lookup import PromptLookup, lookup_generate_step
from edgemoe.streaming.budget import minimum_bytes

PROMPT = np.random.default_rng(5).integers(3, 500, 24).tolist()


def drafted(steps):
    """[(token, logprobs, from_draft)] of a speculative generator, evaluated."""
    return [(int(t), np.array(lp), d) for t, lp, d in steps]


@pytest.mark.parametrize("family,budget", [("qwen3_moe", "100%"), ("qwen3_moe", "25%"),
                                           ("qwen3_moe", "minimum"), ("mixtral", "minimum"),
                                           ("olmoe", "minimum"), ("deepseek_v3", "minimum")])
def test_a_draft_model_speculates_as_mlx_lm_does(checkpoints, family, budget):
    """The same draft, the same int4 checkpoint: mlx-lm's speculative decode of its own
    model and of the streamed one (read in place) give the same tokens, the same
    drafted-or-not, and logprobs bit for bit."""
    target = checkpoints[family][1]
    draft = mlx_lm_load(str(checkpoints["qwen3_moe"][1]))[0]  # same tokenizer, resident
    limit = budget if budget != "minimum" else minimum_bytes(open_source(target))
    prompt = mx.array(PROMPT)
    expected = drafted(speculative_generate_step(prompt, mlx_lm_load(str(target))[0], draft,
                                                 num_draft_tokens=3, max_tokens=16))
    model, _ = edgemoe.load(target, expert_budget=limit)
    got = drafted(speculative_generate_step(prompt, model, draft, num_draft_tokens=3,
                                            max_tokens=16))
    model.expert_store.close()
    assert [(t, d) for t, _, d in got] == [(t, d) for t, _, d in expected]
    assert all(np.array_equal(a, b) for (_, a, _), (_, b, _) in zip(got, expected))
    assert any(d for _, _, d in got) or family != "qwen3_moe"  # its own draft is right


def test_prompt_lookup_gives_greedy_decodes_tokens_and_drafts_only_on_a_match(packs):
    """A prompt that repeats itself: lookup drafts from its 3-token matches, and the
    tokens are greedy decode's (one verification call per window)."""
    model, tokenizer = edgemoe.load(packs["qwen3_moe"]["hf"], expert_budget=0.25)
    prompt = mx.array((PROMPT[:8] * 4)[:-1])
    plain = [int(t) for t, _ in generate_step(prompt, model, max_tokens=24)]
    steps = list(lookup_generate_step(prompt, model, PromptLookup(3), max_tokens=24))
    assert [t for t, _, _ in steps] == plain
    assert any(d for _, _, d in steps)
    assert PromptLookup(3).draft([1, 2, 3, 4, 9, 1, 2, 3], 5) == [4, 9, 1]
    assert PromptLookup(3).draft([1, 2, 3, 4, 9, 2, 3], 5) == []  # a 2-token match: none
    assert PromptLookup(3).draft([1, 2, 3, 4, 1, 2, 3], 1) == [4]
    # and through generate, the text of plain greedy generate
    assert generate(model, tokenizer, prompt.tolist(), max_tokens=24,
                    draft_model=PromptLookup(3)) == \
        generate(model, tokenizer, prompt.tolist(), max_tokens=24)
    model.expert_store.close()


def test_the_generate_cli_drafts_as_mlx_lm_generate_does(checkpoints):
    import subprocess
    import sys

    target, draft = str(checkpoints["mixtral"][1]), str(checkpoints["qwen3_moe"][1])
    common = ["--model", target, "--draft-model", draft, "--num-draft-tokens", "2",
              "--prompt", "import json", "--max-tokens", "16", "--verbose", "F"]

    def run(*argv):
        return subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True,
                              check=True).stdout

    ours = run("edgemoe.generate", *common, "--expert-budget", "25%")
    assert ours.strip() and ours == run("mlx_lm.generate", *common).split("\n", 1)[1]


@pytest.mark.parametrize("argv,message", [
    (["--prompt-lookup", "--draft-model", "x"], "one draft at a time"),
    (["--prompt-lookup", "--routing", "prerouted"],
     "rejected drafts would leave the predicted routing"),
    (["--prompt-lookup", "--max-kv-size", "64"], "a KV cache it can trim")])
def test_a_draft_generate_cannot_use_is_one_usage_line(argv, message, capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)

    with pytest.raises(SystemExit) as e:
        generate_tool.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]
