"""Peak memory under a budget, the generation API's statistics, and the CLI."""

import json
import subprocess
import sys


import mlx.core as mx

import edgemoe
from edgemoe.format.pack import Pack

from conftest import error_line, tool_module

PEAK = """
import json, sys, mlx.core as mx, numpy as np
from mlx_lm.generate import generate_step
kind, path = sys.argv[1], sys.argv[2]
if kind == "mlx_lm":
    from mlx_lm import load
    model, _ = load(path)
else:
    import edgemoe
    model, _ = edgemoe.load(path, expert_budget=float(kind))
prompt = mx.array(np.random.default_rng(0).integers(3, 500, 64))
for _ in generate_step(prompt, model, max_tokens=32):
    pass
print(json.dumps({"peak": mx.get_peak_memory()}))
"""


def peak_memory(kind, path):
    out = subprocess.run([sys.executable, "-c", PEAK, kind, str(path)], check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])["peak"]


def test_quarter_budget_peak_memory_below_45_percent_of_mlx_lm(packs, checkpoints):
    pack = Pack.open(packs["qwen3_moe_large"]["hf"])
    assert pack.expert_bytes > 0.8 * (pack.expert_bytes + pack.resident_bytes)
    resident = peak_memory("mlx_lm", checkpoints["qwen3_moe_large"][1])
    streamed = peak_memory("0.25", pack.path)
    assert streamed < 0.45 * resident, (streamed, resident)


def test_stream_generate_reports_expert_statistics(packs):
    model, tokenizer = edgemoe.load(packs["olmoe"]["hf"], expert_budget=0.25)
    responses = list(edgemoe.stream_generate(model, tokenizer, "hello world", max_tokens=8))
    last = responses[-1]
    assert last.finish_reason in ("stop", "length") and last.generation_tokens >= 1
    assert last.prompt_experts.loads > 0
    routed = last.decode_experts.hits + last.decode_experts.loads
    assert routed > 0 and routed % (4 * 4) == 0  # whole tokens: 4 layers, top-4
    assert 0 <= last.decode_experts.hit_rate <= 1 and last.peak_rss > 0
    text = edgemoe.generate(model, tokenizer, "hello world", max_tokens=8)
    assert text == "".join(r.text for r in responses)


def test_generate_cli(packs):
    out = subprocess.run(
        [sys.executable, "-m", "edgemoe.generate", "--model", str(packs["qwen3_moe"]["hf"]),
         "--prompt", "hello", "--max-tokens", "12", "--expert-budget", "25%", "--seed", "1"],
        capture_output=True, text=True, check=True,
    ).stdout
    for line in ("Prompt: ", "Generation: 12 tokens", "tokens-per-sec", "Peak memory: ",
                 "peak RSS: ", "Experts: read ", "hit rate", "ms/token"):
        assert line in out, out


def test_generate_cli_errors_are_one_clear_line(tmp_path, packs):
    generate = tool_module("generate")  # in this process: the exit is the tool boundary's
    assert "no such model folder" in error_line(generate.main, "--model", tmp_path / "nope")
    assert "the minimum is" in error_line(generate.main, "--model", packs["qwen3_moe"]["hf"],
                                          "--expert-budget", "1KB")


def test_convert_cli(checkpoints, tmp_path):
    dst = tmp_path / "pack"
    args = [sys.executable, "-m", "edgemoe.convert", "--hf-path",
            str(checkpoints["qwen3_moe"][0]), "--mlx-path", str(dst)]
    subprocess.run(args, check=True, capture_output=True)
    assert Pack.open(dst).top_k == 2
    assert "already exists" in error_line(tool_module("convert").main, *args[3:])


def test_trace_records_every_token_and_layer(packs, tmp_path):
    trace_path = tmp_path / "trace.npz"
    subprocess.run(
        [sys.executable, "-m", "edgemoe.generate", "--model", str(packs["olmoe"]["hf"]),
         "--prompt", "hello", "--max-tokens", "6", "--ignore-chat-template",
         "--trace", str(trace_path), "--verbose", "false"],
        check=True, capture_output=True,
    )
    from edgemoe.streaming.trace import load_trace

    trace = load_trace(trace_path)
    n_tokens, n_layers, k = trace["routed"].shape
    assert (n_layers, k) == (4, 4) and list(trace["layers"]) == [0, 1, 2, 3]
    assert trace["decode"].sum() >= 5 and not trace["decode"][0]
    assert trace["routed"].min() >= 0 and trace["routed"].max() < 16
    # top-k ids are distinct within a token
    assert all(len(set(row)) == k for row in trace["routed"].reshape(-1, k).tolist())


def test_prompt_and_decode_split_before_the_first_decode_step(packs):
    """`prompt_experts` is the prompt alone (mlx-lm runs a step ahead of what it yields):
    it equals a fresh model's counters after the same prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    path = packs["qwen3_moe"]["hf"]
    model, tokenizer = edgemoe.load(path, expert_budget=0.5)
    prompt = list(range(3, 23))
    last = None
    for last in edgemoe.stream_generate(model, tokenizer, prompt, max_tokens=6):
        pass
    fresh, _ = edgemoe.load(path, expert_budget=0.5)
    cache = make_prompt_cache(fresh)
    fresh(mx.array(prompt[:-1])[None], cache=cache)  # as mlx-lm prefills
    fresh(mx.array(prompt[-1:])[None], cache=cache)
    alone = fresh.expert_store.snapshot()
    fresh(mx.array([7])[None], cache=cache)  # one decode step: what a token requests
    per_token = fresh.expert_store.snapshot().requests - alone.requests
    # (requests, not hits: whether a prefetch lands before its call is the reader's timing)
    assert last.prompt_experts.requests == alone.requests
    assert last.decode_forwards == last.generation_tokens  # each decode step, counted
    assert last.decode_experts.requests == per_token * last.decode_forwards > 0
