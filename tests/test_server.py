"""The OpenAI-compatible server, over a real loopback socket.

One server process (a small expert budget, at most 4 requests decoded together) serves
every test here; each request has a bounded length and each client call a timeout.
"""

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.sample_utils import make_sampler

import edgemoe

FAMILY, BUDGET, MAX_BATCH = "qwen3_moe", "0.25", 4  # 4 of 16 slots: batches overflow them
TIMEOUT = httpx.Timeout(60.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(*args):
    """`python -m edgemoe.server ARGS` on a free loopback port; yields its URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "edgemoe.server", "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "WARNING", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            pytest.fail(f"the server exited: {proc.stderr.read()}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not start within 60 s")
        time.sleep(0.2)
    try:
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def server(packs):
    with running_server("--model", str(packs[FAMILY]["hf"]), "--expert-budget", BUDGET,
                        "--max-batch", str(MAX_BATCH),
                        "--routing", "advisory") as url:  # prefetching must not change output
        yield url


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, timeout=TIMEOUT, **kw)


def metrics(url):
    return httpx.get(f"{url}/metrics", timeout=TIMEOUT).json()


def prompts(n):
    """Token-id prompts of different lengths (1 to 40 tokens)."""
    rng = np.random.default_rng(3)
    lengths = [1, 5, 40, 9, 23, 2, 14, 31][:n]
    return [rng.integers(3, 500, k).tolist() for k in lengths]


def completion(url, prompt, max_tokens=16, **extra):
    """A greedy completion: (token ids, logprobs, text, finish_reason)."""
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens,
                                      "temperature": 0, "logprobs": True, **extra})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    content = choice["logprobs"]["content"]
    return ([c["id"] for c in content], [c["logprob"] for c in content],
            choice["text"], choice["finish_reason"])


def stream(url, path, body):
    """The SSE events of a streamed request, parsed; the last is '[DONE]'."""
    events = []
    with httpx.stream("POST", url + path, json={**body, "stream": True},
                      timeout=TIMEOUT) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: "):]
                events.append(data if data == "[DONE]" else json.loads(data))
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_health_models_metrics(server):
    assert httpx.get(f"{server}/health", timeout=TIMEOUT).json() == {"status": "ok"}
    models = httpx.get(f"{server}/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list" and models["data"][0]["object"] == "model"
    m = metrics(server)
    for key in ("requests", "tokens", "batch", "latency_s", "experts"):
        assert key in m
    assert m["experts"]["slots_per_layer"] < 16  # the budget really limits the pool


def test_greedy_completion_equals_edgemoe_generate(server, packs):
    """Alone, the server decodes exactly what mlx-lm's loop does on the same model."""
    model, tokenizer = edgemoe.load(packs[FAMILY]["hf"], expert_budget=float(BUDGET))
    eos = set(tokenizer.eos_token_ids)
    for prompt in prompts(3):
        expected = [int(t) for t, _ in generate_step(
            mx.array(prompt), model, max_tokens=12, sampler=make_sampler(0.0))]
        ids, _, _, finish = completion(server, prompt, max_tokens=12)
        assert ids and ids == expected[:len(ids)]  # at least one token, and mlx-lm's
        assert len(ids) == 12 or (finish == "stop" and ids[-1] in eos), (ids, finish)


def test_concurrent_requests_equal_their_outputs_alone(server):
    """Greedy outputs, token ids and logprobs bit for bit, do not depend on the company.

    8 requests against a batch of 4: they join and leave the batch at different steps,
    and half of them wait for a free row first.
    """
    ps = prompts(8)
    alone = [completion(server, p, max_tokens=20) for p in ps]
    before = metrics(server)
    with ThreadPoolExecutor(len(ps)) as pool:
        together = list(pool.map(lambda p: completion(server, p, max_tokens=20), ps))
    after = metrics(server)
    assert together == alone
    assert after["batch"]["max_size_seen"] == MAX_BATCH
    rows = after["batch"]["rows"] - before["batch"]["rows"]
    steps = after["batch"]["steps"] - before["batch"]["steps"]
    assert rows / steps > 1.5, "the requests must have been decoded together"
    assert after["requests"]["active"] == 0 and after["requests"]["waiting"] == 0
    # and nothing of them stays behind: the first prompt alone again, after the crowd
    assert completion(server, ps[0], max_tokens=20) == alone[0]


def test_stream_and_chat_agree_with_non_streamed(server):
    prompt = "import json"
    body = {"prompt": prompt, "max_tokens": 14, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()
    assert whole["object"] == "text_completion" and whole["usage"]["completion_tokens"] >= 1
    events = stream(server, "/v1/completions", {**body, "stream_options":
                                                {"include_usage": True}})
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == \
        whole["choices"][0]["text"]
    assert events[-2]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert events[-1]["choices"] == []
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")  # (not cached_tokens)
    assert [events[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]

    chat = {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": [{"type": "text", "text": "hello"}]}],
            "max_tokens": 10, "temperature": 0}
    whole = post(server, "/v1/chat/completions", chat).json()
    assert whole["object"] == "chat.completion"
    message = whole["choices"][0]["message"]
    assert message["role"] == "assistant"
    events = stream(server, "/v1/chat/completions", chat)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == \
        (message["content"] or "")
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]


def test_stop_string_ends_the_completion_before_it(server):
    prompt = prompts(2)[1]
    _, _, text, _ = completion(server, prompt, max_tokens=16)
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop, text
    r = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 16,
                                         "temperature": 0, "stop": [stop]}).json()
    assert r["choices"][0]["text"] == text[:text.index(stop)]
    assert r["choices"][0]["finish_reason"] == "stop"


def test_seeded_sampling_repeats_alone_and_in_company(server):
    def sample(seed):
        body = {"prompt": "hello", "max_tokens": 8, "temperature": 1.0, "top_p": 0.9,
                "seed": seed}
        r = post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    alone = [sample(seed) for seed in (5, 6, 7)]
    assert len(set(alone)) > 1, "different seeds should sample differently"
    with ThreadPoolExecutor(3) as pool:
        assert list(pool.map(sample, (5, 6, 7))) == alone


BAD = [
    ("/v1/completions", b'{"prompt": "hi", ', "invalid JSON"),
    ("/v1/completions", b'["prompt"]', "must be a JSON object"),
    ("/v1/completions", {"max_tokens": 4}, "'prompt' is required"),
    ("/v1/chat/completions", {"max_tokens": 4}, "'messages' is required"),
    ("/v1/chat/completions", {"prompt": "hi"}, "'prompt' is not supported by chat"),
    ("/v1/chat/completions", {"messages": "hi"}, "'messages' must be a non-empty array"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 3}]},
     "'content' must be a string"),
    ("/v1/completions", {"prompt": 12}, "'prompt' must be a string"),
    ("/v1/completions", {"prompt": [1, 99999]}, "out of range"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -5}, "'max_tokens' must be at least 0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, "'max_tokens' must be at least 1"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "hi", "temperature": "hot"}, "'temperature' must be a"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, "'temperature' must be at least"),
    ("/v1/completions", {"prompt": "hi", "top_p": 2}, "'top_p' must be at most 1"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "'stream' must be a boolean"),
    ("/v1/completions", {"prompt": "hi", "stop": [1]}, "'stop' must be"),
    ("/v1/completions", {"prompt": "hi", "n": 3}, "'n' must be 1"),
    ("/v1/completions", {"prompt": [5] * 1100}, "the model's context is 1024 tokens"),
    ("/v1/completions", {"prompt": [5] * 1000, "max_tokens": 100}, "1100 in all"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', "a lone surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
     "a lone surrogate"),
]


@pytest.mark.parametrize("path,body,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_a_clear_4xx(server, path, body, message):
    if isinstance(body, bytes):
        r = httpx.post(server + path, content=body, timeout=TIMEOUT,
                       headers={"content-type": "application/json"})
    else:
        r = post(server, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert message in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_unknown_routes_and_methods(server):
    r = httpx.get(f"{server}/v1/nothing", timeout=TIMEOUT)
    assert r.status_code == 404 and "no route" in r.json()["error"]["message"]
    r = httpx.get(f"{server}/v1/completions", timeout=TIMEOUT)
    assert r.status_code == 405 and "not allowed" in r.json()["error"]["message"]


def test_client_disconnecting_mid_stream_frees_its_row(server):
    ps = prompts(2)
    alone = completion(server, ps[1], max_tokens=12)
    before = metrics(server)["requests"]
    with httpx.stream("POST", f"{server}/v1/completions", timeout=TIMEOUT,
                      json={"prompt": ps[0], "max_tokens": 900, "stream": True}) as r:
        lines = r.iter_lines()
        got = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert got
    # the client has hung up; the server drops the request at its next step
    wait_until_cancelled(server, before)
    assert completion(server, ps[1], max_tokens=12) == alone


def wait_until_cancelled(server, before):
    """The server counted one more cancelled request, finished none, and went idle."""
    deadline = time.time() + 30
    while True:
        now = metrics(server)["requests"]
        if now["cancelled"] > before["cancelled"] and now["active"] == 0:
            break
        assert time.time() < deadline, now
        time.sleep(0.1)
    assert now["completed"] == before["completed"]


def test_metrics_count_tokens_and_experts(server):
    before = metrics(server)
    ids, _, _, _ = completion(server, prompts(3)[2], max_tokens=10)
    after = metrics(server)
    assert after["tokens"]["generated"] - before["tokens"]["generated"] == len(ids)
    assert after["requests"]["completed"] == before["requests"]["completed"] + 1
    e = after["experts"]
    assert e["bytes_read"] > 0 and e["hits"] > 0 and e["bytes_reused"] > 0
    assert after["tokens"]["tok_per_s"] > 0
    assert after["latency_s"]["p50"] is not None and after["latency_s"]["p95"] >= \
        after["latency_s"]["p50"]


def test_client_timing_out_on_a_non_streamed_request_frees_its_row(server):
    before = metrics(server)["requests"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server}/v1/completions", timeout=httpx.Timeout(60.0, read=0.5),
                   json={"prompt": prompts(1)[0], "max_tokens": 1000})
    wait_until_cancelled(server, before)


def test_a_short_request_is_not_held_behind_a_long_one(server):
    """New requests join the running batch between steps: they do not wait for it."""
    ps = prompts(3)
    finished = {}

    def run(name, prompt, max_tokens):
        events = stream(server, "/v1/completions", {"prompt": prompt,
                                                   "max_tokens": max_tokens})
        finished[name] = (time.perf_counter(), events[-1]["choices"][0]["finish_reason"])

    with ThreadPoolExecutor(2) as pool:
        long = pool.submit(run, "long", ps[0], 400)
        deadline = time.time() + 30
        while metrics(server)["requests"]["active"] == 0:  # the long one is decoding
            assert time.time() < deadline
            time.sleep(0.02)
        pool.submit(run, "short", ps[2], 4).result()
        assert metrics(server)["requests"]["active"] == 1, "the long one still runs"
        long.result()
    assert finished["short"][0] < finished["long"][0]


def alone_and_together(checkpoint, n=6):
    """Greedy (token, logprob) lists of n prompts run one after another on the engine,
    then all at once against a batch of 4 (the second time over the prompt cache)."""
    from edgemoe.serving.engine import Engine
    from edgemoe.serving.job import Job

    engine = Engine(lambda: edgemoe.load(checkpoint, expert_budget=0.5, return_config=True),
                    max_batch=4)
    engine.start(timeout=60)
    try:
        def submit(prompt):
            out, done = [], threading.Event()

            def emit(event):
                out.append(event)
                if event["type"] != "token":
                    done.set()
            assert engine.submit(Job(id="t", prompt=prompt, max_tokens=12, emit=emit))
            return out, done

        def wait(pending):
            out, done = pending
            assert done.wait(60)
            assert out[-1]["type"] == "done", out[-1]
            return [(e["token"], e["logprob"]) for e in out if e["type"] == "token"]

        ps = prompts(n)
        alone = [wait(submit(p)) for p in ps]
        together = [wait(x) for x in [submit(p) for p in ps]]
        assert engine.snapshot()["batch"]["max_size_seen"] == 4
        # some prompts came from the prompt cache (a sliding window's cannot once full)
        assert engine.snapshot()["prompt_cache"]["hits"] >= 2
        return alone, together
    finally:
        engine.stop()


@pytest.mark.parametrize("family", ["mixtral", "olmoe", "deepseek_v3"])
def test_engine_batches_every_family_exactly(family, packs):
    """The other families, on the engine without HTTP: together equals alone."""
    alone, together = alone_and_together(packs[family]["hf"])
    assert together == alone


def test_sliding_window_layers_batch_within_a_rounding_of_alone(tmp_path):
    """gpt_oss's sliding-window layers: mlx-lm's batched rotating KV cache keeps a row's
    window in another order than a lone sequence's cache, so a batched row's logprobs
    differ from alone by a rounding (at most 1e-6 measured), its tokens not at all."""
    from make_family_checkpoints import make_family

    alone, together = alone_and_together(make_family("gpt_oss", tmp_path / "gpt_oss"))
    assert [[t for t, _ in row] for row in together] == [[t for t, _ in row] for row in alone]
    assert max(abs(a - b) for x, y in zip(alone, together)
               for (_, a), (_, b) in zip(x, y)) < 1e-5


def test_stop_strings_are_held_back_until_they_cannot_match():
    from edgemoe.serving.job import Job

    job = Job(id="x", prompt=[1], max_tokens=9, emit=None, stop=["END", "!"])
    sent = []
    for piece in ["abc E", "N", "x E", "ND tail"]:
        job.text += piece
        text, hit = job.releasable(final=False)
        sent.append(text)
        if hit:
            break
    assert sent == ["abc ", "", "ENx ", ""] and hit
    job = Job(id="y", prompt=[1], max_tokens=9, emit=None, stop=["END"])
    job.text = "so E"
    assert job.releasable(final=False) == ("so ", False)
    assert job.releasable(final=True) == ("E", False)  # the end flushes it


@pytest.mark.parametrize("mode", ["prerouted"])
def test_server_serves_prerouted_routing_per_request(mode, tmp_path):
    """Each batch row keeps its own prerouter state: concurrent greedy requests get the
    tokens edgemoe.generate gives each alone (the bundled model's heads, routing every
    layer but the first: the shipped default's cache-conditional layers route among
    slots all requests share)."""
    from edgemoe.format.source import BUNDLED_MODEL
    from edgemoe.routing.between import plain_heads

    heads = str(plain_heads(BUNDLED_MODEL / "prerouter", tmp_path / "heads"))
    model, tokenizer = edgemoe.load(expert_budget=0.25, routing=mode, prerouter_path=heads)
    eos = set(tokenizer.eos_token_ids)
    ps = [np.random.default_rng(i).integers(3, 4000, n).tolist()
          for i, n in enumerate((12, 3, 30, 7))]
    alone = []
    for p in ps:
        tokens = [int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=10,
                                                   sampler=make_sampler(0.0))]
        ends = [i for i, t in enumerate(tokens) if t in eos]
        alone.append(tokens[:ends[0] + 1] if ends else tokens)  # the server stops at EOS
    assert any(len(a) == 10 for a in alone)
    with running_server("--expert-budget", "0.25", "--routing", mode, "--prerouter", heads,
                        "--max-batch", "4") as url:
        with ThreadPoolExecutor(len(ps)) as pool:
            got = list(pool.map(lambda p: completion(url, p, max_tokens=10)[0], ps))
        assert metrics(url)["batch"]["max_size_seen"] > 1  # they really shared steps
    assert got == alone


def test_metrics_count_experts_as_the_store_does(packs):
    """Under advisory prefetch, /metrics' expert figures are the store's own counters
    (a prefetched expert later used is one load and one hit, not a miss)."""
    from edgemoe.serving.engine import Engine
    from edgemoe.serving.job import Job

    engine = Engine(lambda: edgemoe.load(packs[FAMILY]["hf"], expert_budget=0.25,
                                         routing="advisory", return_config=True),
                    max_batch=4)
    engine.start(timeout=60)
    engine.model.expert_store.gate_prefetches(False)  # every prediction read ahead
    try:
        done = [threading.Event() for _ in range(4)]
        for i, p in enumerate(prompts(4)):
            engine.submit(Job(id=str(i), prompt=p, max_tokens=8,
                              emit=lambda e, d=done[i]: e["type"] != "token" and d.set()))
        assert all(d.wait(60) for d in done)
        got = engine.snapshot()["experts"]
        s = engine.model.expert_store.snapshot()
    finally:
        engine.stop()
    assert s.prefetches > 0 and s.hits > 0
    assert got["hit_rate"] == round(s.hit_rate, 4) == round(s.hits / s.requests, 4)
    assert (got["requests"], got["hits"], got["loads"], got["prefetches"]) == \
        (s.requests, s.hits, s.loads, s.prefetches)
    assert got["bytes_used"] == s.bytes_used and got["bytes_reused"] == s.bytes_hit
    assert got["loads"] == got["on_demand"] + got["prefetches"]


@pytest.mark.parametrize("body,field", [
    ({"top_k": 5000, "temperature": 1}, "top_k"),  # at least the vocabulary
    ({"min_p": float("nan"), "temperature": 1}, "min_p"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": -1, "temperature": 1}, "seed"),
    ({"seed": 2**64, "temperature": 1}, "seed"),
])
def test_sampling_parameters_are_checked_before_a_request_joins_a_batch(server, body, field):
    raw = json.dumps({"prompt": "x", "max_tokens": 4, **body})  # NaN and Infinity as JSON has them
    r = httpx.post(f"{server}/v1/completions", content=raw, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_request_whose_sampling_fails_fails_alone(packs):
    """A poisoned row beside innocent ones: it gets its own error, they go on and give
    their outputs alone."""
    from edgemoe.serving.engine import Engine
    from edgemoe.serving.job import Job

    engine = Engine(lambda: edgemoe.load(packs[FAMILY]["hf"], expert_budget=0.5,
                                         return_config=True), max_batch=4)
    engine.start(timeout=60)
    try:
        def submit(prompt, sampling=None):
            out, done = [], threading.Event()

            def emit(event):
                out.append(event)
                if event["type"] != "token":
                    done.set()
            job = Job(id="t", prompt=prompt, max_tokens=10, emit=emit, sampling=sampling)
            assert engine.submit(job)
            return out, done

        def finish(pending):
            out, done = pending
            assert done.wait(60)
            return out

        ps = prompts(3)
        alone = [finish(submit(p)) for p in ps]
        # top_k beyond the vocabulary: passes the engine, raises when the row samples
        together = [submit(ps[0]), submit(ps[1], dict(temp=1.0, top_k=10**6)), submit(ps[2])]
        outs = [finish(x) for x in together]
        assert outs[0][:-1] == alone[0][:-1] and outs[2][:-1] == alone[2][:-1]  # tokens
        assert outs[1][-1]["type"] == "error" and "top_k" in outs[1][-1]["message"]
        m = engine.snapshot()
        assert m["requests"]["failed"] == 1 and m["batch"]["max_size_seen"] >= 2
    finally:
        engine.stop()


def test_only_requests_from_this_servers_own_names_and_pages_are_taken(server):
    """A JSON body is read whatever its content type (`curl -d` sends a form's), but a web
    page of another origin, which can post forms without asking, is refused by its Origin,
    and DNS rebinding, which sends another Host, by its Host; a local name is served."""
    body = json.dumps({"prompt": "x", "max_tokens": 2})
    for kind in ("text/plain", "application/x-www-form-urlencoded"):
        r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT,
                       headers={"content-type": kind})
        assert r.status_code == 200, r.text
        r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT,
                       headers={"content-type": kind, "origin": "https://evil.example"})
        assert r.status_code == 403 and "evil.example" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT,
                   headers={"origin": "http://localhost:3000"})
    assert r.status_code == 200
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT,
                   headers={"content-type": "application/json", "host": "evil.example:80"})
    assert r.status_code == 400 and "evil.example" in r.json()["error"]["message"]
    r = httpx.get(f"{server}/health", headers={"host": "evil.example"}, timeout=TIMEOUT)
    assert r.status_code == 400
    port = server.rsplit(":", 1)[1]
    r = httpx.post(f"{server}/v1/completions", content=body, timeout=TIMEOUT,
                   headers={"content-type": "application/json", "host": f"localhost:{port}"})
    assert r.status_code == 200


def test_oversized_bodies_and_stop_lists_are_refused(server):
    from edgemoe.serving.fields import MAX_STOP_STRINGS
    from edgemoe.serving.http import MAX_BODY_BYTES

    big = json.dumps({"prompt": "x" * (MAX_BODY_BYTES + 1), "max_tokens": 2})
    r = httpx.post(f"{server}/v1/completions", content=big, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413
    r = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2,
                                         "stop": ["s"] * (MAX_STOP_STRINGS + 1)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    deep = "[" * 100000 + "]" * 100000
    r = httpx.post(f"{server}/v1/completions", content=deep, timeout=TIMEOUT,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.headers["content-type"] == "application/json"


def test_a_long_prompt_is_tokenized_off_the_event_loop(server):
    """While a 3 MB prompt is read and checked, /health, polled all along, keeps
    answering: the slowest answer is far from the request's time (it was 9 s while the
    prompt was tokenized; now its byte size refuses it first: edgemoe.serving.limits)."""
    prompt = "def f(x):\n    return x\n" * 130000  # about 3 MB, under the body limit
    latencies = []
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(post, server, "/v1/completions",
                              {"prompt": prompt, "max_tokens": 1})
        tic = time.perf_counter()
        while not pending.done():
            start = time.perf_counter()
            assert httpx.get(f"{server}/health", timeout=TIMEOUT).status_code == 200
            latencies.append(time.perf_counter() - start)
        total = time.perf_counter() - tic
        r = pending.result()
    assert r.status_code == 400  # longer than the model's context
    assert "bytes of text" in r.json()["error"]["message"]  # refused before tokenizing
    assert latencies and max(latencies) < max(total / 2, 1.0), (latencies, total)


def test_streams_never_read_are_cancelled_and_free_their_rows(packs):
    """Two clients send streamed requests and never read (a small receive buffer, so the
    server's send soon blocks): with --send-timeout 1 both are cancelled, and a normal
    request, which had no batch row left, is answered as it is alone."""
    ps = prompts(2)
    with running_server("--model", str(packs[FAMILY]["hf"]), "--max-batch", "2",
                        "--send-timeout", "1", "--send-buffer", "16384") as url:
        alone = completion(url, ps[1], max_tokens=8)
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps({"prompt": ps[0], "max_tokens": 1000, "stream": True,
                           "temperature": 0, "logprobs": True}).encode()
        request = (b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        silent = []
        try:
            for _ in range(2):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                s.connect(("127.0.0.1", port))
                s.sendall(request)
                silent.append(s)
            deadline = time.time() + 30
            while metrics(url)["requests"]["active"] < 2:  # both hold a row
                assert time.time() < deadline
                time.sleep(0.05)
            assert completion(url, ps[1], max_tokens=8) == alone
            while metrics(url)["requests"]["cancelled"] < 2:  # the other, soon after
                assert time.time() < deadline, metrics(url)
                time.sleep(0.05)
            requests = metrics(url)["requests"]
            assert requests["cancelled"] == 2 and requests["completed"] == 2, requests
        finally:
            for s in silent:
                s.close()


@contextlib.contextmanager
def serving_in_process(*argv):
    """edgemoe.server's app on a loopback socket, served by uvicorn on a thread of this
    process (so a test can reach into its reader); yields its url."""
    with served_in_process(*argv) as (url, _):
        yield url


@contextlib.contextmanager
def served_in_process(*argv):
    """As serving_in_process; yields (url, the app's Server)."""
    import uvicorn

    from edgemoe.server import build, setup_arg_parser
    from edgemoe.serving.app import make_app

    engine, server = build(setup_arg_parser().parse_args(list(argv)))
    port = free_port()
    uv = uvicorn.Server(uvicorn.Config(make_app(server), host="127.0.0.1", port=port,
                                       log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.time() + 30
    while not uv.started:
        assert time.time() < deadline and thread.is_alive()
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
        engine.stop()


def test_a_stuck_read_fails_its_request_and_health_says_so(packs, tmp_path, monkeypatch):
    """A read that never returns: /health turns 503 while it is stuck, the request gets a
    JSON 500 naming --read-timeout; a corrupt record then gets a JSON 500 naming the
    expert, and neither carries the server's folders."""
    from conftest import corrupt_record
    from edgemoe.format.pack import Pack
    from edgemoe.streaming import reads as reads_module

    pack = shutil.copytree(packs[FAMILY]["hf"], tmp_path / "secret-folder" / "pack")
    for e in range(Pack.open(pack).layers[0].num_experts):
        corrupt_record(pack, 0, e)  # whatever the routing, the first MoE layer is corrupt
    unstuck, preadv = threading.Event(), os.preadv

    def stuck_preadv(*args):
        unstuck.wait(60)
        return preadv(*args)

    with serving_in_process("--model", str(pack), "--read-timeout", "0.5",
                            "--log-level", "ERROR") as url:
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
        monkeypatch.setattr(reads_module.os, "preadv", stuck_preadv)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post, url, "/v1/completions",
                                  {"prompt": prompts(1)[0], "max_tokens": 4})
            deadline = time.time() + 30
            while httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200:
                assert time.time() < deadline, "health never noticed the stuck read"
                time.sleep(0.05)
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).json() == \
                {"status": "unavailable"}
            r = pending.result(timeout=30)
        assert r.status_code == 500 and "--read-timeout" in r.json()["error"]["message"]
        monkeypatch.setattr(reads_module.os, "preadv", preadv)
        unstuck.set()
        r = post(url, "/v1/completions", {"prompt": prompts(1)[0], "max_tokens": 4})
        message = r.json()["error"]["message"]
        assert r.status_code == 500 and "experts.bin: layer" in message and \
            "checksum mismatch" in message, message
        for r_text in (message, r.text):
            assert "secret-folder" not in r_text and str(tmp_path) not in r_text
        assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200


def test_half_open_connections_are_closed_and_the_server_answers_again(packs):
    """200 connections that send half a request and wait, against --max-connections 32:
    uvicorn alone would keep them for ever and answer every later request with a 503;
    here a new connection closes the oldest half-open one (edgemoe.serving.guard), so
    /health answers 200 at once, and after --request-timeout every one is closed."""
    with running_server("--model", str(packs[FAMILY]["hf"]), "--max-connections", "32",
                        "--request-timeout", "1") as url:
        port = int(url.rsplit(":", 1)[1])
        half_open = []
        try:
            for _ in range(200):
                s = socket.create_connection(("127.0.0.1", port))
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                half_open.append(s)
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200  # room made
            time.sleep(3)
            assert httpx.get(f"{url}/health", timeout=TIMEOUT).status_code == 200
            for s in half_open:  # the server closed each one: an orderly close, or a reset
                s.settimeout(5)  # where it closed before reading the half request
                try:
                    assert s.recv(100) == b""
                except ConnectionResetError:
                    pass
        finally:
            for s in half_open:
                s.close()
