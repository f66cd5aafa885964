"""The server as real clients see it: the official openai, anthropic and ollama Python
libraries over a loopback socket, against `python -m edgemoe.server` on the bundled model
(a quarter of its experts in memory) with a chat template that has tools.

The model is small and random-ish, so tool calls are forced (tool_choice) and then go
through the real parser; everything else is what any client sends.
"""

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from test_server import running_server

TEMPLATE = Path(__file__).parent / "data" / "tools_chat_template.jinja"
MODEL = "edgemoe-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
PROMPTS = ["def read(path):", "import os", "class Node:", "# sort a list", "for i in",
           "while True:", "return None", "print('hi')"]


def server_args(*extra):
    return ("--expert-budget", "25%", "--max-batch", "4", "--model-alias", MODEL,
            "--chat-template", TEMPLATE.read_text(), *extra)


@pytest.fixture(scope="module")
def url():
    with running_server(*server_args()) as url:
        yield url


@pytest.fixture(scope="module")
def other_url():
    """A server with no prompt cache, server-wide sampling defaults and one web origin."""
    with running_server(*server_args("--prompt-cache-size", "0", "--temp", "1.5",
                                     "--cors-origin", "https://app.example")) as url:
        yield url


@pytest.fixture(scope="module")
def oa(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def an(url):
    return anthropic.Anthropic(base_url=url, api_key="none", timeout=60, max_retries=0)


@pytest.fixture(scope="module")
def ol(url):
    return ollama.Client(host=url, timeout=60)


def metrics(url):
    return httpx.get(url + "/metrics", timeout=30).json()


def chat(oa, content, **kw):
    return oa.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                              "content": content}],
                                      max_tokens=kw.pop("max_tokens", 8), temperature=0, **kw)


# ---- OpenAI ------------------------------------------------------------------------------

def test_openai_chat_streams_what_it_answers_whole(oa):
    whole = chat(oa, "hello", max_tokens=12)
    parts = list(chat(oa, "hello", max_tokens=12, stream=True,
                      stream_options={"include_usage": True}))
    text = "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
    assert text == whole.choices[0].message.content
    assert parts[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"


def test_openai_logprobs_give_tokens_as_text_and_bytes(oa):
    r = chat(oa, "def f(x):", max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token
        assert len(c.top_logprobs) == 3
        assert c.top_logprobs[0].token == c.token  # greedy: the most likely one
        assert c.top_logprobs[0].logprob == c.logprob
        assert [t.logprob for t in c.top_logprobs] == sorted(
            (t.logprob for t in c.top_logprobs), reverse=True)


def test_openai_completions_logprobs_n_and_echo(oa):
    prompt = "import json"
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                              logprobs=2, echo=True)
    choice = r.choices[0]
    assert choice.text.startswith(prompt)
    lp = choice.logprobs
    n_prompt = r.usage.prompt_tokens
    assert len(lp.tokens) == n_prompt + 4 and "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[0] is None and all(
        isinstance(x, float) for x in lp.token_logprobs[1:])
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(len(lp.tokens))]
    for top, tok, logprob in list(zip(lp.top_logprobs, lp.tokens, lp.token_logprobs))[n_prompt:]:
        assert len(top) == 2 and top[tok] == logprob


def test_openai_tool_call_round_trip(oa):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                   tool_choice="required", max_tokens=60, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str) and len(args["city"]) <= 12
    # the agent runs the tool and sends the history back: the call, then its result
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    assert messages[1]["content"] is None if "content" in messages[1] else True
    again = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER],
                                       max_tokens=6, temperature=0)
    assert again.choices[0].finish_reason == "length"
    # a named tool, streamed: the call arrives as a delta with its index
    parts = list(oa.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True))
    calls = [c for p in parts for c in (p.choices[0].delta.tool_calls or [])]
    assert [c.index for c in calls] == [0] and calls[0].function.name == "get_weather"
    assert set(json.loads(calls[0].function.arguments)) == {"city"}
    assert parts[-1].choices[0].finish_reason == "tool_calls"


def test_openai_response_format_is_followed(oa):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    r = chat(oa, "a number", max_tokens=30, response_format={
        "type": "json_schema", "json_schema": {"name": "n", "schema": schema}})
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"n"} and 0 <= value["n"] <= 99
    r = chat(oa, "json", max_tokens=200, response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # a random model may not close it in time
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:
        assert r.choices[0].message.content.startswith("{")


def test_openai_penalties_and_logit_bias_change_the_output(oa):
    plain = chat(oa, "x = x + x", max_tokens=12).choices[0].message.content
    penalized = chat(oa, "x = x + x", max_tokens=12, frequency_penalty=2.0,
                     presence_penalty=2.0).choices[0].message.content
    assert penalized != plain
    assert chat(oa, "x = x + x", max_tokens=12, frequency_penalty=2.0,
                presence_penalty=2.0).choices[0].message.content == penalized
    r = chat(oa, "hello", max_tokens=5, logprobs=True, logit_bias={"42": 100})
    assert [c.token for c in r.choices[0].logprobs.content] == \
        [r.choices[0].logprobs.content[0].token] * 5
    assert all(c.bytes == r.choices[0].logprobs.content[0].bytes
               for c in r.choices[0].logprobs.content)


REFUSED = [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "'audio' is not supported"),
    ({"prediction": {"type": "content", "content": "x"}}, "'prediction' is not supported"),
    ({"web_search_options": {}}, "'web_search_options' is not supported"),
    ({"n": 2}, "'n' must be 1"),
    ({"response_format": {"type": "xml"}}, "'response_format.type' must be"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}},
     "'response_format' schema"),
    ({"tool_choice": "required"}, "no 'tools' are given"),
    ({"top_logprobs": 2}, "needs 'logprobs': true"),
    ({"logit_bias": {"x": 1}}, "keys must be token ids"),
    ({"logit_bias": {"5": 1000}}, "must be at most 100"),
    ({"presence_penalty": 3}, "'presence_penalty' must be at most 2"),
]


@pytest.mark.parametrize("extra,message", REFUSED, ids=[m for _, m in REFUSED])
def test_openai_fields_not_implemented_are_a_400_naming_them(oa, extra, message):
    with pytest.raises(openai.BadRequestError, match=message.replace("(", r"\(")):
        chat(oa, "hi", extra_body=extra)


def test_openai_models_and_unknown_names(oa):
    assert {m.id for m in oa.models.list()} >= {MODEL, "edgemoe-reference"}
    assert oa.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("gpt-5")
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oa.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "x"}])


# ---- Anthropic ---------------------------------------------------------------------------

def test_anthropic_messages_whole_and_streamed(an):
    kw = dict(model=MODEL, max_tokens=10, system="Answer in Python.",
              messages=[{"role": "user", "content": "sort a list"}])
    whole = an.messages.create(**kw)
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 10
    with an.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert an.messages.count_tokens(model=MODEL, messages=kw["messages"],
                                    system=kw["system"]).input_tokens == whole.usage.input_tokens


def test_anthropic_tool_use_round_trip(an):
    tool = {"name": "get_weather", "description": "The weather in a city",
            "input_schema": WEATHER["function"]["parameters"]}
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    m = an.messages.create(model=MODEL, max_tokens=60, messages=messages, tools=[tool],
                           tool_choice={"type": "tool", "name": "get_weather"})
    assert m.stop_reason == "tool_use"
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}
    messages += [{"role": "assistant", "content": m.content},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": "cold"}]}]
    with an.messages.stream(model=MODEL, max_tokens=60, messages=messages, tools=[tool],
                            tool_choice={"type": "any"}) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["tool_use"] and \
        set(final.content[0].input) == {"city"}


def test_anthropic_errors_are_anthropic_errors(an):
    with pytest.raises(anthropic.NotFoundError):
        an.messages.create(model="claude-opus-9", max_tokens=5,
                           messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError, match="'thinking' is not supported"):
        an.messages.create(model=MODEL, max_tokens=5, thinking={"type": "enabled",
                                                                "budget_tokens": 1024},
                           messages=[{"role": "user", "content": "x"}])


# ---- Ollama ------------------------------------------------------------------------------

def test_ollama_models_chat_and_generate(ol):
    assert [m.model for m in ol.list().models] == ["edgemoe-reference:latest"]
    shown = ol.show(MODEL)
    assert "tools" in shown.capabilities and "<tool_call>" in shown.template
    options = {"temperature": 0, "num_predict": 10}
    messages = [{"role": "user", "content": "open a file"}]
    whole = ol.chat(model=MODEL, messages=messages, options=options)
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 10
    parts = list(ol.chat(model=MODEL, messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == whole.message.content
    assert parts[-1].done and not any(p.done for p in parts[:-1])
    gen = ol.generate(model=MODEL, prompt="open a file", options=options)
    assert gen.response == whole.message.content  # the same template, the same prompt
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}},
              "required": ["ok"], "additionalProperties": False}
    formatted = ol.chat(model=MODEL, messages=messages, format=schema,
                        options={"temperature": 0, "num_predict": 20})
    assert isinstance(json.loads(formatted.message.content)["ok"], bool)


def test_ollama_takes_tool_history_and_refuses_what_it_cannot_do(ol):
    messages = [{"role": "user", "content": "Weather in Rome?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
                {"role": "tool", "content": "hot", "tool_name": "get_weather"}]
    r = ol.chat(model=MODEL, messages=messages, tools=[WEATHER],
                options={"temperature": 0, "num_predict": 4})
    assert r.done_reason == "length"
    with pytest.raises(ollama.ResponseError, match="options.mirostat"):
        ol.chat(model=MODEL, messages=messages, options={"mirostat": 2})
    with pytest.raises(ollama.ResponseError, match="does not exist"):
        ol.chat(model="llama3", messages=messages)


# ---- all of them ---------------------------------------------------------------------------

def test_greedy_outputs_in_company_equal_their_outputs_alone_through_each_api(oa, an, ol):
    """8 requests at once against a batch of 4, through each API: each answers what it
    answers alone (cached prefixes included: the second round hits the prompt cache)."""
    def via_openai(p):
        r = chat(oa, p, max_tokens=10, logprobs=True)
        return r.choices[0].message.content, [c.logprob for c in r.choices[0].logprobs.content]

    def via_anthropic(p):
        return an.messages.create(model=MODEL, max_tokens=10, messages=[
            {"role": "user", "content": p}]).content[0].text

    def via_ollama(p):
        return ol.chat(model=MODEL, messages=[{"role": "user", "content": p}],
                       options={"temperature": 0, "num_predict": 10}).message.content

    for run in (via_openai, via_anthropic, via_ollama):
        alone = [run(p) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(run, PROMPTS)) == alone, run.__name__


def test_a_second_turn_reuses_the_first_turns_prompt_cache(oa, url, other_url):
    """The second turn of a conversation starts with the first's prompt: it is not
    prefilled again, so fewer expert bytes are read than by the same turn on a server
    with no prompt cache, and the answer is the same."""
    first = [{"role": "system", "content": "You write Python. " * 8},
             {"role": "user", "content": "Read a file line by line."}]
    r1 = oa.chat.completions.create(model=MODEL, messages=first, max_tokens=2, temperature=0)
    second = first + [{"role": "assistant", "content": r1.choices[0].message.content},
                      {"role": "user", "content": "Count them."}]

    def second_turn(client, where):
        before = metrics(where)["prompt_cache"]
        r = client.chat.completions.create(model=MODEL, messages=second, max_tokens=8,
                                           temperature=0)
        after = metrics(where)["prompt_cache"]
        return r, after["prefill_bytes_read"] - before["prefill_bytes_read"], after

    hit, read_hit, cache = second_turn(oa, url)
    assert hit.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 3
    assert cache["hits"] >= 1 and cache["bytes_read_saved_estimate"] > 0
    cold = openai.OpenAI(base_url=other_url + "/v1", api_key="none", timeout=60,
                         max_retries=0)
    cold.chat.completions.create(model=MODEL, messages=first, max_tokens=2, temperature=0)
    miss, read_miss, _ = second_turn(cold, other_url)
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert miss.choices[0].message.content == hit.choices[0].message.content
    assert read_hit < 0.8 * read_miss, (read_hit, read_miss)


def test_server_wide_sampling_defaults_and_web_origins(oa, other_url):
    """--temp applies where a request gives no temperature (greedy is the default);
    --cors-origin lets that origin's pages read responses, and no other."""
    warm = openai.OpenAI(base_url=other_url + "/v1", api_key="none", timeout=60,
                         max_retries=0)
    sampled = {warm.completions.create(model=MODEL, prompt="import", max_tokens=8,
                                       seed=seed).choices[0].text for seed in (1, 2, 3)}
    greedy = {oa.completions.create(model=MODEL, prompt="import", max_tokens=8,
                                    seed=seed).choices[0].text for seed in (1, 2, 3)}
    assert len(sampled) > 1 and len(greedy) == 1
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "content-type"}
    r = httpx.options(other_url + "/v1/chat/completions", headers=preflight, timeout=30)
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.options(other_url + "/v1/chat/completions", timeout=30,
                      headers={**preflight, "Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers


def test_a_reply_is_split_into_reasoning_content_and_tool_calls(tmp_path):
    """mlx-lm's own markers and parser, on a tokenizer that has think tokens: text inside
    <think> is reasoning, a <tool_call> is parsed, whatever the pieces the text comes in."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from transformers import AutoTokenizer

    import edgemoe
    from edgemoe.serving.chat import Reply

    hf = AutoTokenizer.from_pretrained(Path(edgemoe.__file__).parent / "models" / "reference")
    hf.add_tokens(["<think>", "</think>"])
    hf.chat_template = TEMPLATE.read_text()
    hf.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.has_thinking and tok.tool_parser is not None
    text = ('<think>rain? check</think>Let me look.<tool_call>{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}</tool_call>')
    for size in (1, 3, len(text)):
        reply = Reply(tok, tok.encode("hi"), [WEATHER])
        for i in range(0, len(text), size):
            reply.feed(text[i:i + size])
        reply.feed("", final=True)
        assert "".join(reply.reasoning) == "rain? check"
        assert "".join(reply.content) == "Let me look."
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in reply.calls] == [("get_weather", {"city": "Oslo"})]
        assert reply.finish_reason("stop") == "tool_calls"
    # the calls as each API gives them, read by its official client's own types
    from edgemoe.serving.anthropic import MessageView
    from edgemoe.serving.engine import Job
    from edgemoe.serving.ollama import Lines

    job = Job(id="x", prompt=[1, 2], max_tokens=8, emit=print)
    done = {"type": "done", "finish_reason": "stop", "prompt_tokens": 2,
            "completion_tokens": 9, "cached_tokens": 0}
    events = [{"type": "token", "token": 1, "logprob": -1.0, "text": text, "top": None}]
    message = anthropic.types.Message.model_validate(
        MessageView(job, {"model": MODEL}, Reply(tok, [1], [WEATHER])).whole(events, done))
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Oslo"}
    response = ollama.ChatResponse.model_validate(
        Lines(None, job, {"model": MODEL, "chat": True}, Reply(tok, [1], [WEATHER]))
        .whole(events, done))
    assert response.message.thinking == "rain? check"
    assert [(c.function.name, c.function.arguments) for c in response.message.tool_calls] \
        == [("get_weather", {"city": "Oslo"})]
