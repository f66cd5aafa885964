"""OpenAI's Responses API: `POST /v1/responses` (whole, or the stream of events OpenAI's SDK
reads: response.created, response.output_text.delta, response.completed, ...), so that
clients and agents that speak it (openai-agents by default, newer OpenAI clients, coding
agents) connect unchanged.

A request becomes the canonical request (edgemoe.serving.canonical), as every API's does:
`input` (a string, or a list of messages, function calls and their outputs) and
`instructions` are the chat template's messages, `tools` and `tool_choice` its tools (a
forced call decoded under a grammar), `text.format` its response format. The reply's text
and tool calls become output items (edgemoe.serving.responses_view renders them). Nothing is stored: a field that needs a stored response
(previous_response_id, conversation, background) is a 400 naming it, as is any other field
this server does not implement.
"""

import json
import logging
from typing import List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .canonical import Conversation, Generation, Sampling
from .chat import check_tools, text_of, tool_call_message
from .errors import BadRequest
from .fields import (NO_EFFECT, NUMBER, check_reasoning_effort, field, refuse_unknown,
                     response_format_grammar, tool_choice)
from .http import Server
from .responses_view import ResponsesDelivery, ResponseView

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p",
          "tools", "tool_choice", "parallel_tool_calls", "stream", "stream_options", "text",
          "reasoning", "truncation", "include", "max_tool_calls",
          "client_metadata"} | NO_EFFECT  # (Codex's ids of its session: no effect)
ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
# `include` entries that add nothing here: no reasoning is encrypted (a reasoning item
# carries its text), and hosted tools' outputs never occur (those tools are dropped).
# message.output_text.logprobs would add logprobs, which this API does not give: refused.
INCLUDE_NOTHING = {"reasoning.encrypted_content", "web_search_call.action.sources",
                   "web_search_call.results", "file_search_call.results",
                   "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                   "message.input_image.image_url"}
log = logging.getLogger("edgemoe.server")
_dropped_logged = set()  # the hosted tool kinds whose drop was logged (once each)


def error(message: str, status: int = 400, param: Optional[str] = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error"
                                   if status < 500 else "server_error", "param": param,
                                   "code": None}}, status_code=status)


def _drop_hosted(tool: dict):
    """A hosted tool (web_search, file_search, a namespace of tools an agent hosts, ...)
    runs on OpenAI's side or the agent's own, never in the model's reply here: it is left
    out of the prompt, as a model without it would be called. Logged once per kind."""
    kind = tool["type"] + (f" {tool['name']!r}" if isinstance(tool.get("name"), str) else "")
    if kind not in _dropped_logged:
        _dropped_logged.add(kind)
        log.warning("the Responses API: %s tools are not run here; dropped from the "
                    "request (logged once)", kind)


class ResponsesAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self):
        return [Route("/v1/responses", self.responses, methods=["POST"]),
                Route("/responses", self.responses, methods=["POST"])]

    async def responses(self, request: Request):
        return await self.server.respond(
            request, self.parse, ResponseView, error)

    # -- requests ------------------------------------------------------------------------
    def _messages(self, body: dict) -> List[dict]:
        """`instructions` and `input` as the chat template's messages."""
        out: List[dict] = []
        instructions = field(body, "instructions", str)
        if instructions:
            out.append({"role": "system", "content": instructions})
        items = body.get("input")
        if items is None:
            raise BadRequest("'input' is required", "input")
        if isinstance(items, str):
            return out + [{"role": "user", "content": items}]
        return _one_system(out + self._items(items))

    def _items(self, items) -> List[dict]:
        out: List[dict] = []
        if not isinstance(items, list) or not items:
            raise BadRequest("'input' must be a string or a non-empty array of items", "input")
        for i, item in enumerate(items):
            where = f"input[{i}]"
            kind = item.get("type", "message") if isinstance(item, dict) else None
            if kind == "message" and item.get("role") in ROLES:
                refuse_unknown(item, {"type", "role", "content", "id", "status"}, "input",
                               where + ".")
                out.append({"role": ROLES[item["role"]],
                            "content": text_of(_parts(item.get("content"), where), where)})
            elif kind == "function_call":
                call = {"id": call_id(item, where), "type": "function",
                        "function": {"name": item.get("name"),
                                     "arguments": item.get("arguments") or "{}"}}
                calls = tool_call_message([call], where)
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                    out[-1]["tool_calls"] += calls  # calls of one turn: one message
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": calls})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append({"role": "tool", "tool_call_id": call_id(item, where),
                            "content": text_of(_parts(output, where), where)})
            elif kind == "reasoning":
                continue  # a previous turn's reasoning: chat templates drop it too
            else:
                raise BadRequest(f"{where}: a {kind!r} item is not supported (messages of "
                                 f"text, function_call, function_call_output)", "input")
        return out

    def _tools(self, body: dict) -> Optional[list]:
        tools = body.get("tools")
        if tools is None:
            return None
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array", "tools")
        out = []
        for i, t in enumerate(tools):
            if not isinstance(t, dict) or not isinstance(t.get("type"), str):
                raise BadRequest(f"'tools[{i}]' must be a tool object with a 'type'", "tools")
            if t["type"] != "function":
                _drop_hosted(t)
                continue
            refuse_unknown(t, {"type", "name", "description", "parameters", "strict"},
                           "tools", f"tools[{i}].")
            out.append({"type": "function", "function": {
                "name": t.get("name"), "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object"}}})
        return check_tools(out) if out else None

    @staticmethod
    def _function_name(choice: dict) -> str:
        """The name of a forced function: {"type": "function", "name": ...}."""
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise BadRequest("'tool_choice' must be none, auto, required or "
                             "{\"type\": \"function\", \"name\": ...}", "tool_choice")
        return choice["name"]

    def _format(self, body: dict):
        """text.format's grammar (as chat completions' response_format), or None."""
        text = field(body, "text", dict, {})
        refuse_unknown(text, {"format", "verbosity"}, "text", "text.")
        if text.get("verbosity") not in (None, "medium"):
            raise BadRequest("'text.verbosity' is not supported (only \"medium\")",
                             "text.verbosity")
        fmt = field(text, "format", dict, None, where="text.")
        if fmt is not None and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {
                "name": fmt.get("name"), "schema": fmt.get("schema")}}
        try:
            grammar = response_format_grammar(self.server, fmt)
        except BadRequest as e:
            raise BadRequest(e.message.replace("'response_format'", "'text.format'"),
                             "text.format") from None
        if grammar is not None:
            grammar.param = "text.format"
        return grammar

    def parse(self, body: dict):
        s = self.server
        refuse_unknown(body, FIELDS, "the Responses API")
        model = s.model_name(body)
        stream = field(body, "stream", bool, False)
        stream_options = field(body, "stream_options", dict, {})
        refuse_unknown(stream_options, {"include_obfuscation"}, "stream_options",
                       "stream_options.")
        reasoning = field(body, "reasoning", dict, {})
        check_reasoning_effort(s, reasoning, "effort")
        if field(body, "truncation", str, "disabled") != "disabled":
            raise BadRequest("'truncation' must be \"disabled\" (a prompt longer than the "
                             "context is refused, not cut)", "truncation")
        include = field(body, "include", list, [])
        extra = [e for e in include if e not in INCLUDE_NOTHING]
        if extra:
            raise BadRequest(f"'include' {extra[0]!r} is not supported (taken: "
                             f"{', '.join(sorted(INCLUDE_NOTHING))})", "include")
        max_calls = field(body, "max_tool_calls", int, None, lo=1)
        parallel = field(body, "parallel_tool_calls", bool, True)
        messages = self._messages(body)
        tools = self._tools(body)
        choice = tool_choice(body.get("tool_choice"), tools, self._function_name)
        conversation = Conversation(messages, tools, choice, self._format(body),
                                    s.template_args,
                                    max_calls=1 if not parallel else max_calls)
        prompt, grammar, reply = conversation.prompt(s)
        d = s.sampling_defaults
        temperature = field(body, "temperature", NUMBER, d.get("temperature", 0.0), lo=0,
                            hi=2)
        top_p = field(body, "top_p", NUMBER, d.get("top_p", 1.0), lo=0, hi=1)
        job = s.job(Generation(
            prompt, field(body, "max_output_tokens", int, None, lo=1),
            Sampling(temperature=temperature, top_p=top_p, top_k=d.get("top_k", 0),
                     min_p=d.get("min_p", 0.0)),
            max_tokens_name="max_output_tokens", prompt_param="input", grammar=grammar,
            id_prefix="resp_"))
        settings = {
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "temperature": temperature, "top_p": top_p,
            "tools": body.get("tools") or [], "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": parallel, "metadata": body.get("metadata") or {},
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "user": body.get("user"), "store": False, "truncation": "disabled",
            "previous_response_id": None, "reasoning": None, "service_tier": "default"}
        return job, ResponsesDelivery(model, stream, settings), reply


def _one_system(messages: List[dict]) -> List[dict]:
    """The instructions and every system or developer message (Codex sends several), in
    order, as one system message first: chat templates take one, first."""
    system = [m["content"] for m in messages if m["role"] == "system"]
    rest = [m for m in messages if m["role"] != "system"]
    return ([{"role": "system", "content": "\n\n".join(system)}] if system else []) + rest


def _parts(content, where: str):
    """A Responses message's content parts (input_text, output_text) as text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise BadRequest(f"{where}.content[{j}]: {kind!r} parts are not supported "
                             f"(input_text, output_text)", "input")
    return parts


def call_id(item: dict, where: str) -> str:
    """A function call's (or its output's) call_id: required, a non-empty string (the
    tool message would otherwise answer a call "None")."""
    value = item.get("call_id")
    if not (isinstance(value, str) and value):
        raise BadRequest(f"'{where}.call_id' is required: a non-empty string naming the "
                         f"call, got {json.dumps(value)[:60]}", f"{where}.call_id")
    return value
