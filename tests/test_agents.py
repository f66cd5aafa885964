"""Coding agents unchanged: Codex's and Claude Code's recorded requests (tests/data/agents,
made from the CLIs' current npm releases) replayed over a loopback socket against the
server on the bundled model, every streamed event parsed by the official clients' stream
parsers and checked against their event types; the prompt cache on disk across turns,
restarts and scopes.

The recorded prompts (17,219 tokens for Claude Code, 9,134 for Codex) fit the bundled
model's 32,768-token context, but prefilling them takes minutes on 2 CPU cores: the suite
sends them whole against a context narrowed to 2,048, where the one refusal is the
context's, in each API's shape, and cut to fit (`fit`: long texts shortened, the session's
own tools kept, every field, message, block and tool kind as recorded), where they run
through. docs/server.md shows them whole against the real CLIs (scripts/agents_live.sh).
"""

import contextlib
import hashlib
import json
import logging
import os
import re
import sys
import time
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from anthropic.types.beta import BetaRawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from test_server import served_in_process

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
from agent_requests import claude_code, claude_code_counts, codex, fit, split  # noqa: E402

MODEL = "edgemoe-fine"
CLAUDE = claude_code()
CODEX = codex()


@contextlib.contextmanager
def serving(*argv):
    """edgemoe.server's app on a loopback socket (uvicorn on a thread of this process,
    so its log reaches caplog and a test may narrow its context); yields (url, server)."""
    with served_in_process("--max-tokens", "4", *argv) as served:
        yield served


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory):
    with serving("--prompt-cache-dir", str(tmp_path_factory.mktemp("kv"))) as running:
        yield running


@pytest.fixture(scope="module")
def url(agent_server):
    return agent_server[0]


@contextlib.contextmanager
def narrowed(server, context: int):
    """The server's context narrowed to `context` tokens for the block."""
    wide, server.context_length = server.context_length, context
    try:
        yield
    finally:
        server.context_length = wide


def anthropic_client(url, key="agent"):
    return anthropic.Anthropic(base_url=url, api_key=key, timeout=120, max_retries=0)


def openai_client(url, key="agent"):
    return openai.OpenAI(base_url=url + "/v1", api_key=key, timeout=120, max_retries=0)


# ---- the recorded turns, whole ---------------------------------------------------------

def test_whole_recorded_turns_are_refused_only_for_the_context(agent_server, caplog):
    """Sent as recorded past a 2,048-token context, each turn is refused for one reason, the
    context, in its API's shape, with a log line naming the client; count_tokens of Claude
    Code's turn counts what the refusal counted."""
    url, server = agent_server
    caplog.set_level(logging.WARNING, "edgemoe.server")
    with narrowed(server, 2048):
        refused_for_the_context(url, caplog)


def refused_for_the_context(url, caplog):
    counted = []
    for r in CLAUDE + CODEX:
        reply = httpx.post(url + r["path"], json=r["body"], timeout=120,
                           headers={"user-agent": r["headers"]["user-agent"]})
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        # Anthropic's words for it, which Claude Code matches; OpenAI's shape for Codex
        words = (r"prompt is too long: (\d+) tokens > 2047 maximum$" if "messages" in r["path"]
                 else r"the prompt is (\d+) tokens; the model's context is 2048 tokens")
        found = re.match(words, error["message"])
        assert found and error["type"] == "invalid_request_error", error
        counted.append(int(found.group(1)))
    assert min(counted) > 2048
    logged = caplog.text
    assert "400 POST /v1/messages from 127.0.0.1:" in logged and "claude-cli/2.1.332" in logged
    assert "400 POST /v1/responses from 127.0.0.1:" in logged and "codex_exec/0.171.0" in logged
    assert "web_search tools are not run here" in logged
    assert "namespace 'multi_agent_v1' tools are not run here" in logged
    body = {k: CLAUDE[0]["body"][k] for k in ("model", "messages", "system", "tools",
                                              "thinking", "context_management",
                                              "output_config")}
    assert anthropic_client(url).beta.messages.count_tokens(
        **split(body, anthropic_client(url).beta.messages.count_tokens)[0],
        extra_body=split(body, anthropic_client(url).beta.messages.count_tokens)[1],
    ).input_tokens == counted[0]
    with pytest.raises(anthropic.BadRequestError, match="prompt is too long: 17"):
        known, extra = split(CLAUDE[0]["body"], anthropic_client(url).beta.messages.create)
        anthropic_client(url).beta.messages.create(**known, extra_body=extra)


def test_claude_codes_token_counts_are_answered(url):
    """Its /context report's 23 count_tokens requests, as recorded: each counted (200),
    and the SDK reads each answer."""
    client = anthropic_client(url)
    counts = []
    for r in claude_code_counts():
        reply = httpx.post(url + r["path"], json=r["body"], timeout=120,
                           headers={"user-agent": r["headers"]["user-agent"]})
        assert reply.status_code == 200, reply.text
        known, extra = split(r["body"], client.beta.messages.count_tokens)
        counted = client.beta.messages.count_tokens(**known, extra_body=extra)
        assert counted.input_tokens == reply.json()["input_tokens"] > 0
        counts.append(counted.input_tokens)
    assert max(counts) > 2048  # (its whole tool set: counted, though no prompt could hold it)


# ---- the recorded turns, cut to fit: every event parsed ---------------------------------

RAW_EVENTS = {"message_start", "message_delta", "message_stop", "content_block_start",
              "content_block_delta", "content_block_stop"}


def check_message_events(events):
    """Claude Code's order: message_start, blocks (start, deltas, stop), message_delta,
    message_stop; every event valid as the SDK's type, strictly."""
    adapter = TypeAdapter(BetaRawMessageStreamEvent)
    for event in events:
        adapter.validate_python(event.to_dict())
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    open_block = None
    for e in events[1:-2]:
        if e.type == "content_block_start":
            assert open_block is None
            open_block = e.index
        elif e.type in ("content_block_delta", "content_block_stop"):
            assert e.index == open_block
            if e.type == "content_block_stop":
                open_block = None
    assert open_block is None


def test_claude_code_session_streams_events_its_parser_takes(url):
    client = anthropic_client(url)
    usages = []
    for r in CLAUDE:
        known, extra = split(fit(r["body"]), client.beta.messages.stream)
        with client.beta.messages.stream(**known, extra_body=extra, extra_headers={
                "anthropic-beta": r["headers"]["anthropic-beta"]}) as stream:
            # the wire's events (the SDK adds its own, text and input_json, from them)
            events = [e for e in stream if e.type in RAW_EVENTS]
            final = stream.get_final_message()
        check_message_events(events)
        assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")
        usages.append(final.usage)
    # turns after the first start with its prompt: read from the prompt cache
    assert usages[1].cache_read_input_tokens >= 0.9 * usages[0].input_tokens
    assert usages[2].cache_read_input_tokens >= 0.9 * usages[0].input_tokens


def test_a_turn_past_the_first_stages_context_runs_on_the_bundled_model(url):
    """The bundled model's 32,768-token context (its agent stage): Claude Code's recorded
    turn, cut less, is past the first stage's 2,048 tokens, and runs through whole."""
    client = anthropic_client(url)
    count = client.beta.messages.count_tokens
    for chars in (400, 800, 1600, 3200):  # the least cut that is past 2,048 tokens
        body = fit(CLAUDE[0]["body"], chars=chars)
        known, extra = split({k: body[k] for k in ("model", "messages", "system", "tools")},
                             count)
        counted = count(**known, extra_body=extra).input_tokens
        if counted > 2100:
            break
    assert 2100 < counted < 8192, counted
    known, extra = split(body, client.beta.messages.create)
    reply = client.beta.messages.create(**known, extra_body=extra)
    assert reply.usage.input_tokens == counted
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_codex_turn_streams_events_its_parser_takes(url):
    client = openai_client(url)
    adapter = TypeAdapter(ResponseStreamEvent)
    for r in CODEX:
        known, extra = split(fit(r["body"]), client.responses.create)
        events = list(client.responses.create(**known, extra_body=extra, stream=True))
        for event in events:
            adapter.validate_python(event.to_dict())
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        done = events[-1].response
        assert done.usage.input_tokens > 0 and done.output


# ---- fields agents send -------------------------------------------------------------------

def test_agent_fields_are_taken_and_honoured_where_they_change_something(agent_server):
    url, server = agent_server
    client = anthropic_client(url)
    ask = dict(model=MODEL, max_tokens=3, messages=[
        {"role": "user", "content": "hi"}, {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "again"}])
    for thinking in ({"type": "disabled"}, {"type": "enabled", "budget_tokens": 1024},
                     {"type": "adaptive"}):
        client.beta.messages.create(**ask, thinking=thinking, output_config={
            "effort": "low"}, context_management={"edits": []})
    folded = client.beta.messages.count_tokens(model=MODEL, messages=ask["messages"])
    upfront = client.beta.messages.count_tokens(
        model=MODEL, system="Be brief.",
        messages=[m for m in ask["messages"] if m["role"] != "system"])
    assert folded.input_tokens == upfront.input_tokens
    with pytest.raises(anthropic.BadRequestError, match="'output_config.format'"):
        client.beta.messages.create(**ask, output_config={"format": {"type": "json"}})
    # a max_tokens past the context is lowered to it, and the stop says which bound held
    prompt = client.beta.messages.count_tokens(model=MODEL,
                                               messages=ask["messages"]).input_tokens
    with narrowed(server, prompt + 3):
        reply = client.beta.messages.create(**{**ask, "max_tokens": 32000})
    assert reply.usage.output_tokens <= 3
    if reply.usage.output_tokens == 3:
        assert reply.stop_reason == "model_context_window_exceeded"


def test_ollama_pings_and_errors_as_ollama(url):
    assert httpx.head(url + "/").status_code == 200
    assert httpx.get(url + "/").text == "Ollama is running"
    reply = httpx.get(url + "/api/nothing")
    assert reply.status_code == 404 and reply.json() == {"error": "no route /api/nothing"}
    answer = ollama.Client(host=url, timeout=120).chat(
        model=MODEL, messages=[{"role": "user", "content": "hi"}],
        options={"num_ctx": 131072, "num_predict": 2})
    assert answer.done


# ---- the prompt cache on disk ----------------------------------------------------------

def three_turns(url, key: str, turns: int = 3):
    """(prompt tokens, cached tokens) of Claude Code's recorded turns (cut to fit), each
    sent whole (not streamed), under API key `key`."""
    client = anthropic_client(url, key)
    out = []
    for r in CLAUDE[:turns]:
        known, extra = split(fit(r["body"]), client.beta.messages.create)
        reply = client.beta.messages.create(**known, extra_body=extra)
        out.append((reply.usage.input_tokens, reply.usage.cache_read_input_tokens))
    return out


def test_prompt_cache_on_disk_outlives_a_restart_and_keeps_to_its_scope(tmp_path):
    folder = tmp_path / "kv"
    with serving("--prompt-cache-dir", str(folder)) as (url, _):
        first = three_turns(url, "alice")
    assert first[0][1] == 0
    assert all(cached >= first[0][0] - 2 for _, cached in first[1:]), first
    (entries,) = [list(d.glob("*.safetensors")) for d in folder.iterdir()]
    # turn 2's entry replaced turn 1's (its prefix); turn 3 (`claude -p --continue`)
    # renders turn 1's reply otherwise than turn 2 did, so it shares only turn 1's prompt
    assert len(entries) == 2
    with serving("--prompt-cache-dir", str(folder), "--prompt-cache-size", "2") as (url, _):
        again = three_turns(url, "alice")
        other = three_turns(url, "bob", turns=2)
    print("turns (input tokens, cached):", first, again, other)
    # after the restart, every turn of alice's is read from disk but its last 3 tokens
    # (the last is decoded, not prefilled; the prefill keeps at least 2: PromptCache.fetch)
    assert all(cached == tokens - 3 for tokens, cached in again), again
    # bob's prompts are alice's: he learns nothing of them, and prefills his own
    assert other[0][1] == 0 and other[1][1] > 0


def test_a_disk_entry_is_complete_or_absent(tmp_path, monkeypatch):
    """A write that dies leaves nothing behind, a crash's stale temporary file is removed
    at start, a live write's is left alone, and an entry evicted by another process is a
    miss, not an error."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from edgemoe.serving.disk_cache import STALE_TMP_S, DiskPromptCache

    def kv(n):
        c = KVCache()
        c.update_and_fetch(mx.ones((1, 2, n, 4)), mx.ones((1, 2, n, 4)))
        return [c]

    disk = DiskPromptCache(tmp_path, {"model": "m"}, max_bytes=1 << 30)
    save = mx.save_safetensors

    def dies(path, arrays, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(mx, "save_safetensors", dies)
    with pytest.raises(OSError):
        disk.save("s", [1, 2, 3, 4], kv(4))
    assert list(disk.folder.glob("*.safetensors")) == []
    monkeypatch.setattr(mx, "save_safetensors", save)
    stale, live = disk.folder / ".tmp-1-a.safetensors", disk.folder / ".tmp-2-b.safetensors"
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    os.utime(stale, (time.time() - STALE_TMP_S - 1,) * 2)
    disk.save("s", [1, 2, 3, 4], kv(4))
    other = DiskPromptCache(tmp_path, {"model": "m"}, max_bytes=1 << 30)
    assert not stale.exists() and live.exists()
    cache, length = other.load("s", [1, 2, 3, 4, 5], better_than=0)
    assert length == 4 and cache[0].offset == 4
    assert other.load("t", [1, 2, 3, 4, 5], better_than=0) == (None, 0)  # another scope
    disk._remove(disk.entries[next(iter(disk.entries))])  # evicted by the first
    assert other.load("s", [1, 2, 3, 4, 5], better_than=0) == (None, 0)
    assert DiskPromptCache(tmp_path, {"model": "n"}, 1 << 30).folder != disk.folder


def test_thinking_is_honoured_on_a_model_that_thinks(tmp_path):
    """On a model with think tokens whose template switches on enable_thinking (as
    Qwen3's does), `thinking` disabled renders the closed empty think block, enabled and
    adaptive leave the model to think; on the bundled model (no think tokens) it changes
    nothing (test_agent_fields_are_taken...)."""
    from transformers import AutoTokenizer

    import edgemoe

    fine = Path(edgemoe.__file__).parent / "models" / "fine"
    changed = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
    for f in fine.iterdir():
        if f.name not in changed + ("manifest.json",):
            (tmp_path / f.name).symlink_to(f)
    hf = AutoTokenizer.from_pretrained(fine)
    hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = (fine / "chat_template.jinja").read_text().replace(
        '{{- "<|im_start|>assistant\\n" }}',
        '{{- "<|im_start|>assistant\\n" }}{%- if enable_thinking is defined and not '
        'enable_thinking %}{{- "<think>\\n\\n</think>\\n\\n" }}{%- endif %}')
    hf.save_pretrained(tmp_path)
    # the copy's manifest checksums its own tokenizer files, as convert would have
    manifest = json.loads((fine / "manifest.json").read_text())
    manifest["files"].update({name: hashlib.sha256((tmp_path / name).read_bytes()).hexdigest()
                              for name in changed})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    with serving("--model", str(tmp_path)) as (url, server):
        assert server.tokenizer.has_thinking
        client = anthropic_client(url)
        ask = dict(model=server.model_id, messages=[{"role": "user", "content": "hi"}])
        counts = {kind: client.beta.messages.count_tokens(
            **ask, thinking={"type": kind}).input_tokens
            for kind in ("disabled", "enabled", "adaptive")}
        plain = client.beta.messages.count_tokens(**ask).input_tokens
    assert counts["enabled"] == counts["adaptive"] == plain < counts["disabled"], counts
