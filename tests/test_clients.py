"""The server as real clients see it: the official openai, anthropic and ollama Python
libraries, agent frameworks (LangChain, pydantic-ai, openai-agents), the `llm` CLI and an
evaluation harness's request shapes, over a loopback socket, against `python -m
edgemoe.server` on the bundled model (a quarter of its experts in memory) with its own
chat template, which has tools.

The model is small and random-ish, so tool calls are forced (tool_choice) and then go
through the real parser; everything else is what any client sends.
"""

import json
import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from test_server import free_port, running_server

TEMPLATE = Path(__file__).parent / "data" / "tools_chat_template.jinja"
# ChatML without tools: a model whose template has no tool-call format
PLAIN_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{{ message['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MODEL = "edgemoe-test"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
PROMPTS = ["def read(path):", "import os", "class Node:", "# sort a list", "for i in",
           "while True:", "return None", "print('hi')"]


def server_args(*extra):
    return ("--expert-budget", "25%", "--max-batch", "4", "--model-alias", MODEL, *extra)


@pytest.fixture(scope="module")
def url():
    """The bundled model as it ships: its own chat template."""
    with running_server(*server_args()) as url:
        yield url


@pytest.fixture(scope="module")
def plain_template(tmp_path_factory):
    path = tmp_path_factory.mktemp("template") / "plain.jinja"
    path.write_text(PLAIN_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def other_url(plain_template):
    """A server with no prompt cache, server-wide sampling defaults, one web origin, and
    a chat template without tools read from a file."""
    with running_server(*server_args("--prompt-cache-size", "0", "--temp", "1.5",
                                     "--cors-origin", "https://app.example",
                                     "--chat-template", str(plain_template))) as url:
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


def complete(oa, prompt, **kw):
    return oa.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw).choices[0].text


def test_openai_penalties_and_logit_bias_change_the_output(oa):
    # a continuation that repeats itself (a chat turn of the bundled model ends first)
    plain = complete(oa, "x = x + x", max_tokens=12)
    penalized = complete(oa, "x = x + x", max_tokens=12, frequency_penalty=2.0,
                         presence_penalty=2.0)
    assert penalized != plain, plain
    assert complete(oa, "x = x + x", max_tokens=12, frequency_penalty=2.0,
                    presence_penalty=2.0) == penalized
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
    assert {m.id for m in oa.models.list()} >= {MODEL, "edgemoe-fine"}
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
    with pytest.raises(anthropic.BadRequestError, match="'thinking.type' must be one of"):
        an.messages.create(model=MODEL, max_tokens=5, thinking={"type": "sometimes"},
                           messages=[{"role": "user", "content": "x"}])


# ---- Ollama ------------------------------------------------------------------------------

def test_ollama_models_chat_and_generate(ol):
    assert [m.model for m in ol.list().models] == ["edgemoe-fine:latest"]
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

    hf = AutoTokenizer.from_pretrained(Path(edgemoe.__file__).parent / "models" / "fine")
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
    from edgemoe.serving.anthropic import MessagesDelivery, MessageView
    from edgemoe.serving.canonical import Result
    from edgemoe.serving.job import Job
    from edgemoe.serving.ollama import Lines, OllamaDelivery

    job = Job(id="x", prompt=[1, 2], max_tokens=8, emit=print)
    done = {"type": "done", "finish_reason": "stop", "prompt_tokens": 2,
            "completion_tokens": 9, "cached_tokens": 0}
    events = [{"type": "token", "token": 1, "logprob": -1.0, "text": text, "top": None}]
    message = anthropic.types.Message.model_validate(
        MessageView(job, MessagesDelivery(MODEL, False), Reply(tok, [1], [WEATHER]))
        .whole(Result(events, done)))
    assert message.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["thinking", "text", "tool_use"]
    assert message.content[2].input == {"city": "Oslo"}
    response = ollama.ChatResponse.model_validate(
        Lines(None, job, OllamaDelivery(MODEL, False), Reply(tok, [1], [WEATHER]))
        .whole(Result(events, done)))
    assert response.message.thinking == "rain? check"
    assert [(c.function.name, c.function.arguments) for c in response.message.tool_calls] \
        == [("get_weather", {"city": "Oslo"})]


# ---- tools on the bundled model, through agent frameworks ------------------------------

def test_langchain_binds_a_tool_and_takes_its_result_back(url):
    """LangChain's @tool schema leaves additionalProperties open: the forced call still
    ends, parsed; with_structured_output's function calling sends parallel_tool_calls."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="none", temperature=0,
                     max_tokens=40, max_retries=0, timeout=60)
    messages = [HumanMessage("Weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    (call,) = ai.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city"}
    assert ai.response_metadata["finish_reason"] == "tool_calls"
    messages += [ai, ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])]
    answer = llm.bind_tools([get_weather]).bind(max_tokens=4).invoke(messages)
    assert isinstance(answer.content, str) and answer.usage_metadata["output_tokens"] == 4

    class City(BaseModel):
        name: str
        country: str

    city = llm.with_structured_output(City, method="function_calling").invoke("Paris?")
    assert isinstance(city, City)


def test_pydantic_ai_agent_calls_its_tool_and_answers(url):
    from dataclasses import dataclass

    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    @dataclass
    class CallFirst(AbstractCapability):
        """The random model would not call on its own: the first step forces it."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": "none", "max_tokens": 4} if ctx.run_step > 1 \
                else {"tool_choice": ["get_weather"]}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=url + "/v1",
                                                          api_key="none"))
    agent = Agent(model, capabilities=[CallFirst()],
                  model_settings={"temperature": 0, "max_tokens": 60})
    cities = []

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    result = agent.run_sync("Weather in Paris?")
    assert len(cities) == 1 and isinstance(result.output, str)
    kinds = [part.part_kind for m in result.all_messages() for part in m.parts]
    assert "tool-call" in kinds and "tool-return" in kinds


def test_openai_agents_runs_a_tool_over_the_responses_api(url):
    """openai-agents speaks the Responses API: a forced call, the tool's output sent back
    as a function_call_output item, then a structured answer (a grammar, so it ends)."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool,
                        set_tracing_disabled)
    from pydantic import BaseModel

    set_tracing_disabled(True)
    cities = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        cities.append(city)
        return f"sunny in {city}"

    class Answer(BaseModel):
        sunny: bool

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0,
                                timeout=60)
    agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather],
                  output_type=Answer,
                  model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", max_tokens=100,
                                               temperature=0))
    result = Runner.run_sync(agent, "Is it sunny in Paris?")
    assert len(cities) == 1 and isinstance(result.final_output, Answer)


def test_llm_cli_sends_tools_and_gets_an_answer(url, tmp_path):
    (tmp_path / "extra-openai-models.yaml").write_text(
        f"- model_id: edge\n  model_name: {MODEL}\n  api_base: {url}/v1\n"
        f"  supports_tools: true\n")
    cli = Path(sys.executable).parent / "llm"
    out = subprocess.run(
        [str(cli), "-m", "edge", "-o", "max_tokens", "6", "-o", "temperature", "0",
         "--functions", "def get_weather(city: str) -> str:\n    'The weather'\n"
                        "    return 'sunny'", "Weather in Paris?"],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "LLM_USER_PATH": str(tmp_path), "OPENAI_API_KEY": "none"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip()


def test_a_forced_call_with_an_open_schema_ends_parsed_or_reports_its_cut(oa, ol):
    open_schema = {"type": "function", "function": {
        "name": "search", "parameters": {"type": "object", "properties": {
            "query": {"type": "string"}, "limit": {"type": "integer"}}}}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "find json"}],
              tools=[open_schema], tool_choice="required", temperature=0)
    r = oa.chat.completions.create(max_tokens=120, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    assert set(json.loads(call.function.arguments)) <= {"query", "limit"}
    cut = oa.chat.completions.create(max_tokens=12, **kw)  # cut inside the arguments
    assert cut.choices[0].finish_reason == "length"
    (partial,) = cut.choices[0].message.tool_calls
    assert partial.function.name == "search"
    assert call.function.arguments.startswith(partial.function.arguments)
    # Ollama's tools (auto): the bundled template has a parser, so they are taken
    r = ol.chat(model=MODEL, messages=[{"role": "user", "content": "find json"}],
                tools=[open_schema], options={"temperature": 0, "num_predict": 4})
    assert r.done_reason == "length"


def test_a_model_without_a_tool_format_still_takes_forced_calls(other_url):
    """A chat template without tools (so no parser): tool_choice none needs none, a
    forced call is decoded under the grammar and returned, auto is a 400 saying why."""
    client = openai.OpenAI(base_url=other_url + "/v1", api_key="none", timeout=60,
                           max_retries=0)
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}],
              tools=[WEATHER], temperature=0, max_tokens=60)
    r = client.chat.completions.create(tool_choice="required", **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(r.choices[0].message.tool_calls[0].function.arguments)) == {"city"}
    assert client.chat.completions.create(tool_choice="none", **{**kw, "max_tokens": 3}) \
        .choices[0].message.tool_calls is None
    with pytest.raises(openai.BadRequestError, match="no tool-call format"):
        client.chat.completions.create(**kw)
    claude = anthropic.Anthropic(base_url=other_url, api_key="none", timeout=60,
                                 max_retries=0)
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    m = claude.messages.create(model=MODEL, max_tokens=60, tools=[tool],
                               tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather?"}])
    assert m.stop_reason == "tool_use" and set(m.content[-1].input) == {"city"}
    with pytest.raises(ollama.ResponseError, match="does not support tools"):
        ollama.Client(host=other_url, timeout=60).chat(
            model=MODEL, messages=[{"role": "user", "content": "x"}], tools=[WEATHER])
    shown = httpx.post(other_url + "/api/show", json={"model": MODEL}, timeout=30).json()
    assert shown["template"] == PLAIN_TEMPLATE  # --chat-template read the file it named
    assert "tools" not in shown["capabilities"]


# ---- what clients send ---------------------------------------------------------------------

def test_fields_clients_send_routinely_are_accepted(oa, ol):
    r = chat(oa, "hi", max_tokens=3, extra_body={
        "parallel_tool_calls": False, "service_tier": "auto", "user": "u1",
        "reasoning_effort": "low", "prompt_cache_key": "k", "safety_identifier": "s",
        "seed": None, "stop": None, "logit_bias": None, "frequency_penalty": None,
        "functions": None, "audio": None})
    assert r.choices[0].finish_reason == "length"
    r = ol.generate(model=MODEL, prompt="hi", options={
        "temperature": 0, "num_predict": 3, "mirostat": 0, "mirostat_tau": 5.0,
        "tfs_z": 1.0, "typical_p": 1.0, "penalize_newline": True})
    assert r.done_reason == "length"
    for option in ({"typical_p": 0.5}, {"tfs_z": 0.9}):
        with pytest.raises(ollama.ResponseError, match="options." + next(iter(option))):
            ol.generate(model=MODEL, prompt="hi", options={"num_predict": 2, **option})


def test_curl_d_without_a_json_header_works_and_other_origins_are_refused(url):
    """Ollama's documented `curl -d` (a form content type) is served; a page of another
    origin is refused before any route, whatever it sends."""
    curl = subprocess.run(
        ["curl", "-s", "-d", json.dumps({"model": MODEL, "prompt": "hi", "stream": False,
                                         "options": {"num_predict": 2}}),
         url + "/api/generate"], capture_output=True, text=True, timeout=60)
    assert json.loads(curl.stdout)["done"] is True, curl.stdout
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                       "max_tokens": 1})
    page = {"content-type": "text/plain", "origin": "https://evil.example"}
    for path in ("/v1/chat/completions", "/api/chat", "/v1/messages", "/v1/responses"):
        r = httpx.post(url + path, content=body, headers=page, timeout=30)
        assert r.status_code == 403, (path, r.text)


def test_an_empty_reply_is_an_empty_string(oa):
    r = chat(oa, "hi", logit_bias={"0": 100})  # <|endoftext|> (0) first: nothing written
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == ""


def test_ollama_durations_are_the_requests_own(ol):
    tic = time.perf_counter()
    r = ol.generate(model=MODEL, prompt="def f(x):", options={"temperature": 0,
                                                             "num_predict": 12})
    wall_ns = (time.perf_counter() - tic) * 1e9
    assert r.eval_count == 12 and r.done_reason == "length"
    assert r.prompt_eval_duration + r.eval_duration <= r.total_duration <= wall_ns
    assert r.eval_duration > 0.2 * (r.total_duration - r.prompt_eval_duration)
    assert r.eval_duration / r.eval_count > 100_000  # not tens of microseconds a token


# ---- completions as evaluation harnesses use them ---------------------------------------

def test_completion_text_is_exactly_its_tokens(oa):
    """The first token's leading space is kept: prompt + completion is what the model wrote."""
    prompt = "import os\nfrom sys import"
    r = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                              logprobs=0)
    choice = r.choices[0]
    assert choice.text == "".join(choice.logprobs.tokens)
    assert choice.logprobs.tokens[0].startswith(" ")
    streamed = oa.completions.create(model=MODEL, prompt=prompt, max_tokens=6,
                                     temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    # echoed with logprobs, streamed or not: the prompt's tokens, then the completion's
    kw = dict(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True,
              logprobs=1)
    whole = oa.completions.create(**kw).choices[0]
    assert whole.text == prompt + choice.text == "".join(whole.logprobs.tokens)
    parts = [p.choices[0].logprobs for p in oa.completions.create(stream=True, **kw)
             if p.choices[0].logprobs]
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert [x for lp in parts for x in getattr(lp, key)] == \
            getattr(whole.logprobs, key), key


def test_completions_take_every_prompt_form_a_choice_each(oa):
    texts = ["def read(path):", "import os"]
    ids = [oa.completions.create(model=MODEL, prompt=t, max_tokens=0, echo=True,
                                 logprobs=0).usage.prompt_tokens for t in texts]
    alone = [oa.completions.create(model=MODEL, prompt=t, max_tokens=5, temperature=0)
             .choices[0].text for t in texts]
    r = oa.completions.create(model=MODEL, prompt=texts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1] and [c.text for c in r.choices] == alone
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == sum(ids)
    tokens = [oa.completions.create(model=MODEL, prompt=t, max_tokens=0, echo=True,
                                    logprobs=0).choices[0].logprobs.content for t in texts]
    tokens = [[c["id"] for c in content] for content in tokens]
    r = oa.completions.create(model=MODEL, prompt=tokens, max_tokens=5, temperature=0)
    assert [c.text for c in r.choices] == alone
    r = oa.completions.create(model=MODEL, prompt=tokens[0], max_tokens=5, temperature=0)
    assert r.choices[0].text == alone[0]
    parts = list(oa.completions.create(model=MODEL, prompt=texts, max_tokens=5,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    for i in (0, 1):
        assert "".join(p.choices[0].text for p in parts
                       if p.choices and p.choices[0].index == i) == alone[i]
    assert parts[-1].usage.completion_tokens == 10


def test_eval_harness_loglikelihood_matches_edgemoe_eval(url):
    """lm-evaluation-harness's local-completions loglikelihood request (token-id prompts,
    echo, logprobs 1, max_tokens 0), scored as edgemoe.eval scores the same tokens."""
    import mlx.core as mx
    import numpy as np

    import edgemoe
    from edgemoe.eval import log_probs

    model, tokenizer = edgemoe.load(expert_budget=0.25)
    contexts = ["def add(a, b):\n    return", "import json\n\ndata = json."]
    continuations = [" a + b", "loads(text)"]
    prompts = [tokenizer.encode(c + x) for c, x in zip(contexts, continuations)]
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 0,
        "logprobs": 1, "seed": 1234, "echo": True}).json()
    for choice, prompt, context in zip(sorted(r["choices"], key=lambda c: c["index"]),
                                       prompts, contexts):
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(prompt) and lp["token_logprobs"][0] is None
        assert choice["text"] == contexts[choice["index"]] + continuations[choice["index"]]
        expected = log_probs(model, np.array(prompt))
        chosen = mx.take_along_axis(expected, mx.array(prompt[1:])[:, None], axis=-1)
        np.testing.assert_allclose(lp["token_logprobs"][1:], np.array(chosen[:, 0]),
                                   atol=2e-4)
        greedy = np.array(mx.argmax(expected, axis=-1)).tolist()
        for top, best in zip(lp["top_logprobs"][1:], greedy):  # is_greedy's question
            (token,) = top
            assert token == tokenizer.decode([best])
        # the harness's continuation score: the tokens after the context
        start = len(tokenizer.encode(context))
        assert math.isfinite(sum(lp["token_logprobs"][start:]))
    assert r["usage"]["completion_tokens"] == 0


# ---- the Responses API ---------------------------------------------------------------------

def test_responses_create_and_stream(oa):
    r = oa.responses.create(model=MODEL, input="hello", instructions="Be brief.",
                            max_output_tokens=8, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.output_text
    # bounded, so that it closes: the bundled model writes an unbounded integer's digits on
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    text = {"format": {"type": "json_schema", "name": "n", "schema": schema}}
    with oa.responses.stream(model=MODEL, input=[{"role": "user", "content": "a number"}],
                             max_output_tokens=30, temperature=0, text=text) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert final.status == "completed" and "".join(deltas) == final.output_text
    assert isinstance(json.loads(final.output_text)["n"], int)
    whole = oa.responses.create(model=MODEL, input=[{"role": "user", "content": "a number"}],
                                max_output_tokens=30, temperature=0, text=text)
    assert whole.output_text == final.output_text
    # a function tool, its call and its output
    tool = {"type": "function", "name": "get_weather", "description": "The weather",
            "parameters": WEATHER["function"]["parameters"]}
    r = oa.responses.create(model=MODEL, input="Weather in Oslo?", tools=[tool],
                            tool_choice="required", max_output_tokens=60, temperature=0)
    (call,) = r.output
    assert r.status == "completed" and call.type == "function_call"
    assert set(json.loads(call.arguments)) == {"city"}
    again = oa.responses.create(model=MODEL, tools=[tool], max_output_tokens=4, input=[
        {"role": "user", "content": "Weather in Oslo?"}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "cold"}])
    assert again.usage.input_tokens > r.usage.input_tokens
    for extra, name in (({"previous_response_id": "resp_1"}, "previous_response_id"),
                        ({"include": ["message.output_text.logprobs"]}, "include")):
        with pytest.raises(openai.BadRequestError, match=name):
            oa.responses.create(model=MODEL, input="x", **extra)


# ---- all of them, at once --------------------------------------------------------------

def test_greedy_outputs_of_eight_mixed_requests_equal_each_alone(oa, an, ol):
    """Chat, completions, responses, Anthropic and Ollama requests, 8 at once against a
    batch of 4: each answers what it answers alone."""
    calls = [
        lambda: chat(oa, "open a file", max_tokens=10).choices[0].message.content,
        lambda: oa.completions.create(model=MODEL, prompt="def f(x):", max_tokens=10,
                                      temperature=0).choices[0].text,
        lambda: oa.responses.create(model=MODEL, input="sort a list", temperature=0,
                                    max_output_tokens=10).output_text,
        lambda: an.messages.create(model=MODEL, max_tokens=10, messages=[
            {"role": "user", "content": "class Node:"}]).content[0].text,
        lambda: ol.chat(model=MODEL, messages=[{"role": "user", "content": "while True:"}],
                        options={"temperature": 0, "num_predict": 10}).message.content,
        lambda: ol.generate(model=MODEL, prompt="import os", raw=True,
                            options={"temperature": 0, "num_predict": 10}).response,
        lambda: oa.completions.create(model=MODEL, prompt=["for i in", "return None"],
                                      max_tokens=10, temperature=0).choices[1].text,
        lambda: "".join(p.choices[0].delta.content or "" for p in chat(
            oa, "print('hi')", max_tokens=10, stream=True) if p.choices),
    ]
    alone = [call() for call in calls]
    with ThreadPoolExecutor(len(calls)) as pool:
        assert list(pool.map(lambda call: call(), calls)) == alone


def test_a_stream_cut_by_shutdown_ends_with_an_error_event():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "edgemoe.server", "--port", str(port),
                             "--log-level", "WARNING", *server_args()],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        with httpx.stream("POST", url + "/v1/chat/completions", timeout=60, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 400, "stream": True}) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            assert "choices" in json.loads(next(lines)[len("data: "):])
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert "error" in json.loads(rest[-1][len("data: "):]), rest[-3:]
        assert proc.wait(timeout=30) is not None
    finally:
        proc.kill()
        proc.wait()
