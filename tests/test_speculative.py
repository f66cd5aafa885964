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
from edgemoe.mlx_backend.families import find_experts
from edgemoe.mlx_backend.generation import generate
from edgemoe.mlx_backend.drafts import draft_generate_step
from edgemoe.mlx_backend.lookup import PromptLookup
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
    in_place = open_source(target, find_experts=find_experts)
    limit = budget if budget != "minimum" else minimum_bytes(in_place)
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
    steps = list(draft_generate_step(prompt, model, PromptLookup(3), max_tokens=24))
    assert [t for t, _, _ in steps] == plain
    assert any(d for _, _, d in steps)
    assert PromptLookup(3).draft([1, 2, 3, 4, 9, 1, 2, 3], 3) == [4, 9, 1]
    assert PromptLookup(3).draft([1, 2, 3, 4, 9, 1, 2, 3], 5) == [4, 9, 1, 2, 3]
    assert PromptLookup(3).draft([1, 2, 3, 4, 9, 2, 3], 5) == []  # a 2-token match: none
    assert PromptLookup(3).draft([1, 2, 3, 4, 1, 2, 3], 1) == [4]
    # and through generate, the text of plain greedy generate
    assert generate(model, tokenizer, prompt.tolist(), max_tokens=24,
                    draft_model=PromptLookup(3)) == \
        generate(model, tokenizer, prompt.tolist(), max_tokens=24)
    model.expert_store.close()


@pytest.mark.parametrize("source,adaptive", [("qwen3_moe", True), ("qwen3_moe", False),
                                             ("mixtral", True)])
def test_a_draft_model_in_our_loop_gives_greedy_decodes_tokens(checkpoints, packs, source,
                                                               adaptive):
    """A DraftModel (our loop: a length that adapts, or a fixed one) right every time
    (its own weights) or never (another family's random weights): greedy decode's tokens."""
    from edgemoe.mlx_backend.drafts import DraftModel

    model, tokenizer = edgemoe.load(packs["qwen3_moe"]["mlx"], expert_budget=0.25)
    draft = DraftModel(mlx_lm_load(str(checkpoints[source][1]))[0], 3)
    plain = [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=20)]
    steps = list(draft_generate_step(mx.array(PROMPT), model, draft, max_tokens=20,
                                     adaptive=adaptive))
    assert [t for t, _, _ in steps] == plain
    assert any(d for _, _, d in steps) == (source == "qwen3_moe")
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
    (["--prompt-lookup", "--max-kv-size", "64"], "a KV cache it can trim"),
    (["--draft-model", "x", "--kv-bits", "4"], "keeps the KV cache unquantized")])
def test_a_draft_generate_cannot_use_is_one_usage_line(argv, message, capsys):
    generate_tool = importlib.import_module("edgemoe.generate")  # (edgemoe.generate: the function)

    with pytest.raises(SystemExit) as e:
        generate_tool.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err.strip().splitlines()[-1]


# ---- the server's engine: a request decoded alone speculates -----------------------------

def engine_run(target, load_draft, requests, budget=0.25):
    """[(tokens, logprobs)] of `requests` [(prompt, max_tokens, sampling)] submitted
    together to an engine (batches of up to 4), and its metrics."""
    import threading

    from edgemoe.serving.engine import Engine
    from edgemoe.serving.job import Job

    engine = Engine(lambda: edgemoe.load(target, expert_budget=budget, return_config=True),
                    max_batch=4, load_draft=load_draft)
    engine.start(timeout=60)
    try:
        pending = []
        for prompt, max_tokens, sampling, *fields in requests:
            out, done = [], threading.Event()

            def emit(event, out=out, done=done):
                out.append(event)
                if event["type"] != "token":
                    done.set()
            assert engine.submit(Job(id="t", prompt=prompt, max_tokens=max_tokens,
                                     emit=emit, sampling=sampling, **dict(*fields)))
            pending.append((out, done))
        results = []
        for out, done in pending:
            assert done.wait(120) and out[-1]["type"] == "done", out[-1:]
            tokens = [e for e in out if e["type"] == "token"]
            results.append(([e["token"] for e in tokens], [e["logprob"] for e in tokens]))
        return results, engine.snapshot()
    finally:
        engine.stop()


def same_output(got, expected):
    """Tokens equal; logprobs equal to a rounding (a window's multi-token attention)."""
    assert [t for t, _ in got] == [t for t, _ in expected]
    for (_, a), (_, b) in zip(got, expected):
        np.testing.assert_allclose(a, b, atol=1e-4)


@pytest.mark.parametrize("draft", ["same weights", "other family", "lookup"])
def test_the_server_engine_speculates_with_a_lone_requests_own_tokens(checkpoints, packs,
                                                                     draft):
    """Greedy and seeded: with a draft, a request alone gets the tokens it gets without
    one, and the drafts were verified in windows (kept where right, dropped where not)."""
    from edgemoe.mlx_backend.drafts import DraftModel

    target = packs["qwen3_moe"]["mlx"]  # the draft "same weights" is its source
    source = {"same weights": "qwen3_moe", "other family": "mixtral"}.get(draft)
    load_draft = (lambda tok: PromptLookup(3)) if source is None else \
        (lambda tok: DraftModel(mlx_lm_load(str(checkpoints[source][1]))[0], 3))
    prompt = (PROMPT[:8] * 4)[:-1] if draft == "lookup" else PROMPT
    for sampling in (None, {"temp": 0.8, "seed": 7}):
        requests = [(prompt, 20, sampling)]
        plain, _ = engine_run(target, None, requests)
        got, m = engine_run(target, load_draft, requests)
        same_output(got, plain)
        spec = m["speculative"]
        assert spec["windows"] and spec["drafted"]
        if sampling is None:
            if draft == "same weights":  # its own weights draft greedy decode's tokens
                assert spec["accepted"] == spec["drafted"]
            if draft == "lookup":  # windows with some drafts kept, and some dropped
                assert 0 < spec["accepted"] < spec["drafted"]
            if draft == "other family":  # random weights of another family: all dropped
                assert spec["accepted"] < spec["drafted"]


def test_a_requests_num_draft_tokens_fixes_its_windows(checkpoints, packs):
    """A request's num_draft_tokens (6, over the draft's 2) is its windows' length: a draft
    of the target's own weights, kept whole, makes 20 greedy tokens in windows of 7, 7, 6
    (the last one short of max_tokens); without it DraftLength keeps to at most 2."""
    from edgemoe.mlx_backend.drafts import DraftModel

    target = packs["qwen3_moe"]["mlx"]
    load_draft = lambda tok: DraftModel(mlx_lm_load(str(checkpoints["qwen3_moe"][1]))[0], 2)
    plain, _ = engine_run(target, None, [(PROMPT, 20, None)])
    got, m = engine_run(target, load_draft, [(PROMPT, 20, None, {"num_draft_tokens": 6})])
    same_output(got, plain)
    assert m["speculative"] == {**m["speculative"], "windows": 3, "drafted": 17, "accepted": 17}
    _, m = engine_run(target, load_draft, [(PROMPT, 20, None)])
    assert m["speculative"]["windows"] >= 20 // 3


def test_a_request_left_alone_in_the_batch_speculates_from_where_it_is(checkpoints, packs):
    """Two requests decode as a batch (one token per row), the shorter one ends, and
    the other speculates from there, its draft first fed the tokens it decoded in the
    batch: each gets the tokens it gets alone without a draft."""
    from edgemoe.mlx_backend.drafts import DraftModel

    target = packs["qwen3_moe"]["hf"]
    requests = [(PROMPT, 4, None), (PROMPT[3:], 20, None)]
    alone = [engine_run(target, None, [r])[0][0] for r in requests]
    draft = lambda tok: DraftModel(mlx_lm_load(str(checkpoints["mixtral"][1]))[0], 3)
    got, m = engine_run(target, draft, requests)
    for g, a in zip(got, alone):
        same_output([g], [a])
    assert m["batch"]["max_size_seen"] == 2 and m["speculative"]["windows"] > 0


def test_draft_length_follows_what_windows_keep_and_cost():
    """Drafts that are kept and windows that cost little: the most; drafts never kept:
    none, but for a probe now and then; windows whose reads grow with their length: fewer."""
    from edgemoe.mlx_backend.drafts import PROBE_EVERY, DraftLength

    def settle(chance, seconds, rounds=400):
        """The lengths chosen over the last 2 * PROBE_EVERY windows, each draft kept
        with `chance` (its predecessor kept), a window of k drafts taking seconds(k)."""
        length, rng, chosen = DraftLength(4), np.random.default_rng(0), []
        for _ in range(rounds):
            k = length.choose()
            kept = 0
            while kept < k and rng.random() < chance:
                kept += 1
            length.record(k, kept + 1, seconds(k))
            chosen.append(k)
        return sorted(chosen[-2 * PROBE_EVERY:])

    probes = 2  # of the last 2 * PROBE_EVERY windows; sorted, at the other end
    assert settle(0.95, lambda k: 1.0 + 0.1 * k)[probes:] == [4] * (2 * PROBE_EVERY - probes)
    assert settle(0.0, lambda k: 1.0 + 0.1 * k)[:-probes] == [0] * (2 * PROBE_EVERY - probes)
    dear = settle(0.6, lambda k: 1.0 + 1.0 * k)  # each draft as dear as a plain step
    cheap = settle(0.6, lambda k: 1.0 + 0.05 * k)
    assert dear[PROBE_EVERY] < cheap[PROBE_EVERY]


def test_the_server_speculates_over_http_and_refuses_a_draft_it_cannot_use(packs):
    """`edgemoe.server --prompt-lookup`: a completion's tokens and logprobs are those of
    the server without a draft, and /metrics counts the windows. A request's own
    `num_draft_tokens` (mlx_lm.server's field) fixes its windows' length, 0 drafting
    nothing, more than --num-draft-tokens drafting more; a server without a draft
    refuses it with a 400 naming the field."""
    from test_server import completion, metrics, post, running_server

    pack = str(packs["qwen3_moe"]["hf"])
    prompt = (PROMPT[:8] * 4)[:-1]
    with running_server("--model", pack, "--expert-budget", "0.25") as url:
        plain = completion(url, prompt, max_tokens=20)
        assert completion(url, prompt, max_tokens=20, num_draft_tokens=0) == plain
        refused = post(url, "/v1/completions", {"prompt": prompt, "num_draft_tokens": 2})
        assert refused.status_code == 400 and \
            refused.json()["error"]["param"] == "num_draft_tokens"
    with running_server("--model", pack, "--expert-budget", "0.25", "--prompt-lookup",
                        "--num-draft-tokens", "2") as url:
        got = completion(url, prompt, max_tokens=20)
        spec = metrics(url)["speculative"]
        none = completion(url, prompt, max_tokens=20, num_draft_tokens=0)
        after_none = metrics(url)["speculative"]
        more = completion(url, prompt, max_tokens=20, num_draft_tokens=6)
        after_more = metrics(url)["speculative"]
    for run in (got, none, more):
        assert run[0] == plain[0] and run[2] == plain[2]
        np.testing.assert_allclose(run[1], plain[1], atol=1e-4)
    assert spec["windows"] > 0 and spec["accepted"] > 0
    assert after_none["windows"] > spec["windows"] and after_none["drafted"] == spec["drafted"]
    import subprocess
    import sys

    refused = subprocess.run([sys.executable, "-m", "edgemoe.server", "--prompt-lookup",
                              "--routing", "prerouted"], capture_output=True, text=True)
    assert refused.returncode == 2 and "rejected drafts would leave the predicted routing" \
        in refused.stderr.strip().splitlines()[-1]
