"""edgemoe.eval: perplexity, top-1 agreement and KL between two configurations."""

import math
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load

from edgemoe.eval import ModelConfig, evaluate

TEXT = "Beautiful is better than ugly. Explicit is better than implicit. " * 12


def test_pack_agrees_exactly_with_its_mlx_lm_checkpoint(packs, checkpoints):
    result = evaluate([ModelConfig(str(checkpoints["qwen3_moe"][1])),
                       ModelConfig(str(packs["qwen3_moe"]["hf"]), {"budget": "0.25"})],
                      TEXT, context=32)
    assert result["top1_agreement"] == 1.0 and result["mean_kl"] == 0.0
    a, b = result["configs"]
    assert a["perplexity"] == b["perplexity"] and b["expert_hit_rate"] < 1


def test_int4_differs_from_the_unquantized_model(packs, checkpoints):
    result = evaluate([ModelConfig(str(checkpoints["mixtral"][0])),
                       ModelConfig(str(packs["mixtral"]["hf"]))], TEXT, context=32)
    assert result["mean_kl"] > 0 and result["top1_agreement"] < 1


def test_perplexity_is_the_mean_next_token_nll(checkpoints):
    path = str(checkpoints["olmoe"][1])
    result = evaluate([ModelConfig(path)], TEXT, context=1000)
    model, tokenizer = mlx_lm_load(path)
    tokens = mx.array(tokenizer.encode(TEXT))
    logits = model(tokens[None, :-1])[0]
    nll = mx.mean(mx.logsumexp(logits, -1) - mx.take_along_axis(
        logits, tokens[1:, None], -1)[:, 0]).item()
    assert result["tokens"] == tokens.size - 1
    assert result["configs"][0]["perplexity"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_bad_options_are_refused(checkpoints):
    with pytest.raises(ValueError, match="budget=, routing="):
        ModelConfig.parse("x,colour=blue")
    with pytest.raises(ValueError, match="packs and mlx-lm quantized checkpoints only"):
        ModelConfig(str(checkpoints["olmoe"][0]), {"budget": "0.5"}).load()


def test_streaming_options_read_an_mlx_lm_checkpoint_in_place(checkpoints):
    model, _ = ModelConfig(str(checkpoints["olmoe"][1]), {"budget": "0.5"}).load()
    assert model.expert_store.info().in_place


def test_cli(packs, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    out = subprocess.run([sys.executable, "-m", "edgemoe.eval", "--text", str(text),
                          "--model", str(packs["olmoe"]["hf"]), "--context", "32"],
                         check=True, capture_output=True, text=True).stdout
    assert "perplexity" in out


def test_routing_statistics(packs):
    result = evaluate([ModelConfig(str(packs["olmoe"]["hf"]))], TEXT, context=32,
                      routing_stats=True)
    layers = result["routing"]
    assert [r["layer"] for r in layers] == [0, 1, 2, 3]
    for r in layers:
        assert sum(r["counts"]) == result["tokens"] * 4  # every token, top-4
        assert 0 < r["entropy_bits"] <= r["max_entropy_bits"] == 4.0


CODE = '''import os

def read_lines(path):
    with open(path) as f:
        return f.read().splitlines()

for name in sorted(os.listdir(".")):
    print(name)
'''


def test_completion_cases_cut_each_line_before_its_middle():
    from edgemoe.eval import completion_cases

    cases = completion_cases(CODE, 10)
    assert [rest for _, rest in cases] == ["read_lines(path):", "open(path) as f:",
                                           "f.read().splitlines()", 'sorted(os.listdir(".")):']
    for before, rest in cases:  # the text up to the cut, then the line's rest
        assert CODE.startswith(before) and CODE[len(before):].startswith(rest + "\n")
    assert len(completion_cases(CODE, 2)) == 2


def test_line_completion_scores_exact_matches(packs, monkeypatch):
    """A completion counts only when it reproduces the rest of the line; the pack at a small
    budget completes every line as at 100% (native routing is exact)."""
    import edgemoe.eval as ev

    path = str(packs["qwen3_moe"]["hf"])
    result = evaluate([ModelConfig(path), ModelConfig(path, {"budget": "0.25"})], CODE,
                      context=64, completions=4)
    completion = result["completion"]
    assert completion["lines"] == 4 and completion["same_completion"] == 1.0
    assert completion["exact_match"][0] == completion["exact_match"][1]
    answers = iter(["read_lines(path):", "open(path)", "f.read().splitlines()", "sorted(x"])
    monkeypatch.setattr(ev, "complete", lambda *args: next(answers))
    result = evaluate([ModelConfig(path)], CODE, context=64, completions=4)
    assert result["completion"]["exact_match"] == [0.5]
    assert result["completion"]["prefix_matched"] == [pytest.approx(
        (1 + len("open(path)") / len("open(path) as f:") + 1 + len("sorted(") / 24) / 4)]
