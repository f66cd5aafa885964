"""`--experts-per-token K` (StreamOptions.experts_per_token): each token routes to its K
most likely experts in every routing mode (reduced top-k, issue #52), through generate,
the server and eval; the reduced model's logits are mlx-lm's own model's with its MoE
blocks' top_k set to K, bit for bit, and every tool says the routing is not exact."""

import json

import httpx
import mlx.core as mx
import pytest
from mlx_lm.generate import generate as mlx_lm_generate, generate_step
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load as mlx_lm_load

import edgemoe
from edgemoe.eval import compare as eval_compare, main as eval_main
from edgemoe.generate import main as generate_main
from edgemoe.format.source import BUNDLED_MODEL
from edgemoe.mlx_backend.conditional import reduce_top_k
from edgemoe.mlx_backend.experts import streaming_of
from edgemoe.options import StreamOptions
from edgemoe.routing.between import plain_heads
from edgemoe.routing.modes import ExpertsPerToken
from edgemoe.streaming.trace import load_trace

from test_server import served_in_process
from unpack import unpack

K, OWN = 4, 8  # the bundled model routes each token to 8 of its 128 experts
TEXT = "def read_lines(path):\n    with open(path) as f:\n        return f.read().split()\n"
PROMPT, FORCED, DECODED = 24, 8, 12
TIMEOUT = httpx.Timeout(60.0)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """mlx-lm's own models of the bundled pack (unpacked to its checkpoint): as it is, and
    with its MoE blocks' top_k set to K; the tokens of TEXT."""
    folder = unpack(BUNDLED_MODEL, tmp_path_factory.mktemp("fine"))
    full, tokenizer = mlx_lm_load(str(folder))
    reduced, _ = mlx_lm_load(str(folder))
    blocks = [layer.mlp for layer in reduced.model.layers if hasattr(layer.mlp, "top_k")]
    assert len(blocks) == 8 and all(b.top_k == OWN for b in blocks)
    for block in blocks:
        block.top_k = K
    return {OWN: full, K: reduced}, tokenizer.encode(TEXT)


def logits(model, tokens):
    """The prompt's logits, then each forced token's, decoded one at a time."""
    tokens = mx.array(tokens[:PROMPT + FORCED])
    cache = make_prompt_cache(model)
    out = [model(tokens[None, :PROMPT], cache=cache)[0]]
    out += [model(t.reshape(1, 1), cache=cache)[0] for t in tokens[PROMPT:]]
    return mx.concatenate(out)


def greedy(model, tokens, n=DECODED):
    return [int(t) for t, _ in generate_step(mx.array(tokens), model, max_tokens=n,
                                             sampler=make_sampler(0.0))]


def test_k_gives_mlx_lms_logits_with_its_blocks_top_k_and_the_default_its_own(reference):
    models, tokens = reference
    expected = {k: logits(m, tokens) for k, m in models.items()}
    assert not mx.array_equal(expected[K], expected[OWN]).item()
    for given, k in ((K, K), (OWN, OWN), (None, OWN)):  # None: the model's own, exact
        model, _ = edgemoe.load(expert_budget="25%", experts_per_token=given)
        assert streaming_of(model).experts_per_token == ExpertsPerToken(k, OWN)
        assert mx.array_equal(logits(model, tokens), expected[k]).item(), given
        assert model.expert_store.snapshot().bytes_read > 0  # streamed, not resident


@pytest.mark.parametrize("routing", ["native", "advisory", "prerouted"])
def test_generate_routes_each_token_to_k_in_every_mode(routing, reference, tmp_path, capsys):
    """Through edgemoe.generate: every mode's trace routes K experts a token and its
    verbose output says so; the exact modes write mlx-lm's reduced model's text."""
    models, tokens = reference
    trace = tmp_path / "trace.npz"
    generate_main(["--prompt", TEXT, "--ignore-chat-template", "--max-tokens",
                           str(DECODED), "--expert-budget", "25%", "--routing", routing,
                           "--experts-per-token", str(K), "--trace", str(trace)])
    out = capsys.readouterr().out
    text = out.split("\n" + "=" * 10 + "\n")[0]
    assert load_trace(trace)["routed"].shape[-1] == K
    assert f"Routing: {routing}, {K} of {OWN} experts per token (reduced: not exact)" in out
    if routing == "prerouted":  # (the pack's shipped configuration: predicted, not exact)
        return
    assert text == mlx_lm_generate(models[K], edgemoe.load()[1], tokens, max_tokens=DECODED)
    assert text != mlx_lm_generate(models[OWN], edgemoe.load()[1], tokens,
                                   max_tokens=DECODED)


def test_generate_by_default_says_exact(capsys):
    generate_main(["--prompt", TEXT, "--ignore-chat-template", "--max-tokens", "2"])
    assert f"Routing: native, {OWN} of {OWN} experts per token (exact)" in \
        capsys.readouterr().out


def test_the_server_routes_to_k_says_so_and_keys_its_prompt_cache_by_it(reference, tmp_path):
    """Over a loopback socket: greedy completions are mlx-lm's reduced model's; /metrics
    and Ollama's /api/show say 4 of 8; a prompt cache on disk made with K is a folder of
    its own, never the one the model's own k uses."""
    models, tokens = reference
    tokens = tokens[:-3]  # mid-function: at its end the bundled model ends its text
    folder = tmp_path / "kv"
    seen = {}
    for k in (K, None):
        argv = ["--prompt-cache-dir", str(folder), "--expert-budget", "25%"]
        with served_in_process(*argv, *(["--experts-per-token", str(k)] if k else [])) \
                as (url, _):
            r = httpx.post(url + "/v1/completions", timeout=TIMEOUT, json={
                "prompt": tokens, "max_tokens": DECODED, "temperature": 0,
                "logprobs": True})
            assert r.status_code == 200, r.text
            seen[k] = [c["id"] for c in r.json()["choices"][0]["logprobs"]["content"]]
            routing = httpx.get(url + "/metrics", timeout=TIMEOUT).json()["routing"]
            shown = httpx.post(url + "/api/show", json={"model": "edgemoe-fine"}, timeout=TIMEOUT)
        used = k or OWN
        assert routing == {"routing": "native", "exact": k is None,
                           "experts_per_token": f"{used} of {OWN}"}
        assert shown.json()["model_info"]["qwen3_moe.expert_used_count"] == used
    assert seen[K] == greedy(models[K], tokens)[:len(seen[K])] and len(seen[K]) > 1
    assert seen[None] == greedy(models[OWN], tokens)[:len(seen[None])]
    assert seen[K] != seen[None][:len(seen[K])]
    identities = [json.loads((d / "identity.json").read_text()) for d in folder.iterdir()]
    assert len(identities) == 2  # one folder each: neither reuses the other's entries
    assert sorted(i.get("experts_per_token", "own") for i in identities) == [
        f"{K} of {OWN}", "own"]
    assert all(list(d.glob("*.safetensors")) for d in folder.iterdir())


def test_eval_reports_the_reduced_routing_and_its_perplexity(reference, tmp_path):
    """edgemoe.eval's JSON: `experts=K` (and --experts-per-token K) score mlx-lm's
    reduced model's perplexity to the last bit, say it is not exact; the default is the
    model's own."""
    models, tokens = reference
    text = tmp_path / "t.txt"
    text.write_text(TEXT * 4)
    expected = {k: eval_compare([m], edgemoe.load()[1].encode(text.read_text()),
                                        context=32)["perplexity"][0]
                for k, m in models.items()}
    assert expected[K] != expected[OWN]
    runs = {"spec": ["--model", f"{BUNDLED_MODEL},experts={K}"],
            "flag": ["--experts-per-token", str(K)], "default": []}
    for name, argv in runs.items():
        out = tmp_path / f"{name}.json"
        eval_main(["--text", str(text), "--context", "32", "--json", str(out),
                           *argv])
        (config,) = json.loads(out.read_text())["configs"]
        k = OWN if name == "default" else K
        assert config["perplexity"] == expected[k], name
        assert (config["routing"], config["exact"], config["experts_per_token"]) == (
            "native", k == OWN, f"{k} of {OWN}")


def test_heads_route_top_k_and_the_option_the_smaller_wins(tmp_path):
    heads = plain_heads(BUNDLED_MODEL / "prerouter", tmp_path / "heads")
    config = json.loads((heads / "prerouter_config.json").read_text())
    (heads / "prerouter_config.json").write_text(json.dumps({**config, "route_top_k": 6}))
    for given, used in ((None, 6), (K, K), (7, 6)):
        model, _ = edgemoe.load(routing="prerouted", prerouter_path=str(heads),
                                experts_per_token=given)
        assert streaming_of(model).experts_per_token == ExpertsPerToken(used, OWN), given


def test_a_bad_k_is_one_line_naming_the_field(capsys):
    with pytest.raises(SystemExit) as e:
        generate_main(["--experts-per-token", "0"])
    assert e.value.code == 2 and "--experts-per-token: must be at least 1, got 0" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        generate_main(["--experts-per-token", str(OWN + 1), "--max-tokens", "1"])
    assert str(e.value.code) == (f"edgemoe.generate: error: experts_per_token: expected 1 "
                                 f"to the model's own {OWN}, found {OWN + 1}")
    with pytest.raises(ValueError, match="^experts_per_token: expected an integer of at "
                                         "least 1 .*found 0$"):
        StreamOptions(experts_per_token=0)
    with pytest.raises(SystemExit, match="model option experts=four: expected an integer"):
        eval_main(["--text", __file__, "--model", f"{BUNDLED_MODEL},experts=four"])


def test_a_family_without_a_top_k_field_is_refused_in_one_line():
    import mlx.nn as nn

    class Block(nn.Module):  # as mixtral's: its k is num_experts_per_tok
        num_experts_per_tok = 2

    assert reduce_top_k({0: Block()}, None) == 2  # its own k, untouched
    with pytest.raises(ValueError, match="^experts_per_token: expected MoE blocks with a "
                                         "top_k field to reduce, found Block without one"):
        reduce_top_k({0: Block()}, 1)


def test_the_cuda_backend_refuses_it_in_one_line():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import edgemoe.cuda

    with pytest.raises(ValueError, match=f"^experts_per_token {K}: the CUDA backend routes "
                                         "each token to the model's own experts"):
        edgemoe.cuda.load(None, experts_per_token=K)


def test_the_flag_parses_into_the_options():
    import argparse

    parser = StreamOptions.add_arguments(argparse.ArgumentParser())
    assert StreamOptions.from_args(parser.parse_args([])).experts_per_token is None
    options = StreamOptions.from_args(parser.parse_args(["--experts-per-token", str(K)]))
    assert options.experts_per_token == K


def test_a_saved_kv_cache_is_used_only_with_the_experts_it_was_made_with(tmp_path, capsys):
    """edgemoe.cache_prompt records a reduced K in the file; generate refuses the file
    with another K, in one line, and continues it with the same."""
    from edgemoe.cache_prompt import main as cache_prompt_main

    files = {k: tmp_path / f"k{k}.safetensors" for k in (K, OWN)}
    for k, path in files.items():
        cache_prompt_main(["--prompt", TEXT, "--prompt-cache-file", str(path),
                           "--experts-per-token", str(k)])
    ask = ["--prompt", "more", "--max-tokens", "2", "--verbose", "F"]
    for made, given in ((K, None), (K, OWN), (OWN, K)):
        with pytest.raises(SystemExit) as e:
            generate_main(["--prompt-cache-file", str(files[made]), *ask,
                           *(["--experts-per-token", str(given)] if given else [])])
        assert str(e.value.code) == (
            f"edgemoe.generate: error: --prompt-cache-file {files[made]} was made with "
            f"{made} experts per token; this run routes to {given or OWN} "
            f"(--experts-per-token)")
    capsys.readouterr()
    generate_main(["--prompt-cache-file", str(files[K]), *ask, "--experts-per-token", str(K)])
    generate_main(["--prompt-cache-file", str(files[OWN]), *ask])
    assert capsys.readouterr().out.strip()
