"""Anthropic's Messages API: `POST /v1/messages` (whole, or the SDK's stream of events) and
`POST /v1/messages/count_tokens`, with tool use, so agents written for it connect unchanged.

A conversation is turned into the chat template's messages (text blocks, tool_use blocks
as the assistant's tool calls, tool_result blocks as tool messages) and runs as any
other request; the reply's text, reasoning and tool calls become content blocks.
"""

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Dict, List

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .canonical import Conversation, Delivery, Generation, Result, Sampling, ToolChoice
from .chat import Reply, arguments_object, render, text_of
from .errors import BadRequest
from .fields import NUMBER, field, refuse_unknown, stop_strings
from .http import Server, public
from .http import sse as _sse
from .messages_fields import (AGENT_FIELDS, WINDOW_EXCEEDED, check_agent_fields,
                              fold_system, thinking_args)

FIELDS = {"model", "messages", "max_tokens", "system", "stop_sequences", "stream",
          "temperature", "top_p", "top_k", "tools", "tool_choice", "metadata",
          "service_tier"} | AGENT_FIELDS
COUNT_FIELDS = {"model", "messages", "system", "tools", "tool_choice"} | AGENT_FIELDS
STOP = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def error(message: str, status: int = 400) -> JSONResponse:
    kind = {404: "not_found_error", 413: "request_too_large", 503: "overloaded_error"}.get(
        status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}},
                        status_code=status)


@dataclass
class MessagesDelivery(Delivery):
    window_bound: bool = False  # max_tokens was lowered to the context's room


class AnthropicAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self):
        return [Route("/v1/messages", self.messages, methods=["POST"]),
                Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])]

    # -- requests ------------------------------------------------------------------------
    def _conversation(self, body: dict) -> List[dict]:
        """The chat template's messages for `system` and `messages`."""
        out = []
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of "
                             "{\"role\": \"user\"|\"assistant\", \"content\": ...}", "messages")
        system, messages = fold_system(body.get("system"), messages)
        if system is not None:
            out.append({"role": "system", "content": system})
        for i, m in messages:
            where = f"messages.{i}"
            if not (isinstance(m, dict) and m.get("role") in ("user", "assistant")):
                raise BadRequest(f"{where}: 'role' must be user or assistant", "messages")
            refuse_unknown(m, {"role", "content"}, "messages", where + ".")
            content = m.get("content")
            if isinstance(content, str):
                out.append({"role": m["role"], "content": content})
                continue
            if not isinstance(content, list):
                raise BadRequest(f"{where}.content must be a string or an array of "
                                 f"content blocks", "messages")
            out += self._blocks(m["role"], content, where)
        return out

    def _blocks(self, role: str, blocks: list, where: str) -> List[dict]:
        text, calls, results = [], [], []
        for j, b in enumerate(blocks):
            kind = b.get("type") if isinstance(b, dict) else None
            if kind == "text" and isinstance(b.get("text"), str):
                text.append(b["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(b.get("name"),
                                                                            str):
                calls.append({"id": b.get("id"), "type": "function",
                              "function": {"name": b["name"],
                                           "arguments": b.get("input") or {}}})
            elif kind == "tool_result" and role == "user":
                results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id")),
                                "content": text_of(b.get("content"), f"{where}.content.{j}")})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                continue  # a previous turn's reasoning: templates drop it too
            else:
                raise BadRequest(f"{where}.content.{j}: a {kind!r} block is not supported "
                                 f"here (text, tool_use in assistant turns, tool_result in "
                                 f"user turns)", "messages")
        out = list(results)
        if text or calls or not results:
            message: Dict[str, Any] = {"role": role, "content": "".join(text)}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        return out

    def _tools(self, body: dict):
        """Anthropic's tools as the chat template's (OpenAI's) tools."""
        tools = body.get("tools")
        if tools is None:
            return None
        if not isinstance(tools, list):
            raise BadRequest("'tools' must be an array", "tools")
        out = []
        for i, t in enumerate(tools):
            if not (isinstance(t, dict) and isinstance(t.get("name"), str)
                    and isinstance(t.get("input_schema", {}), dict)):
                raise BadRequest(f"'tools.{i}' must be {{\"name\": ..., \"input_schema\": "
                                 f"{{...}}}} (server tools are not supported)", "tools")
            out.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description", ""),
                "parameters": t.get("input_schema") or {"type": "object"}}})
        return out or None

    def parse(self, body: dict):
        s = self.server
        refuse_unknown(body, FIELDS, "the Messages API")
        check_agent_fields(body)
        model = s.model_name(body, required=True)
        if body.get("max_tokens") is None:
            raise BadRequest("'max_tokens' is required", "max_tokens")
        max_tokens = field(body, "max_tokens", int, lo=1)
        messages = self._conversation(body)
        tools = self._tools(body)
        choice = field(body, "tool_choice", dict, {"type": "auto"})
        refuse_unknown(choice, {"type", "name", "disable_parallel_tool_use"}, "tool_choice",
                       "tool_choice.")
        conversation = Conversation(
            messages, tools, self._tool_choice(choice, tools),
            template_args=thinking_args(s, body),
            max_calls=1 if choice.get("disable_parallel_tool_use") else None)
        prompt, grammar, reply = conversation.prompt(s)
        # a max_tokens past the context is a ceiling the context lowers, as Anthropic's
        # API takes it: the reply that reaches the context says so in its stop_reason
        room = s.context_length - len(prompt)
        if room < 1:  # in Anthropic's words, which Claude Code reads (and then compacts)
            raise BadRequest(f"prompt is too long: {len(prompt)} tokens > "
                             f"{s.context_length - 1} maximum", "messages")
        window_bound = room < max_tokens
        d = s.sampling_defaults
        job = s.job(Generation(
            prompt, room if window_bound else max_tokens,
            # a request's own temperature is Anthropic's (0 to 1); the server's --temp
            # default is the server's, on OpenAI's scale (up to 2)
            Sampling(temperature=_or(field(body, "temperature", NUMBER, lo=0, hi=1),
                                     d.get("temperature", 0.0)),
                     top_p=_or(field(body, "top_p", NUMBER, lo=0, hi=1), d.get("top_p", 1.0)),
                     top_k=s.top_k_field(body, default=d.get("top_k", 0)),
                     min_p=d.get("min_p", 0.0),
                     stop=stop_strings(body.get("stop_sequences"), "stop_sequences")),
            prompt_param="messages", grammar=grammar, id_prefix="msg_"))
        delivery = MessagesDelivery(model, field(body, "stream", bool, False), window_bound)
        return job, delivery, reply

    @staticmethod
    def _tool_choice(choice: dict, tools) -> ToolChoice:
        """{"type": "auto" | "any" | "tool" | "none", "name": ...}."""
        kind = choice.get("type")
        if kind in ("none", "auto"):
            return ToolChoice(kind)
        if kind not in ("any", "tool"):
            raise BadRequest(f"'tool_choice.type' must be auto, any, tool or none, got "
                             f"{kind!r}", "tool_choice")
        if not tools:
            raise BadRequest("'tool_choice' asks for tool use, but no 'tools' are "
                             "given", "tool_choice")
        name = choice.get("name") if kind == "tool" else None
        if kind == "tool" and name not in [t["function"]["name"] for t in tools]:
            raise BadRequest(f"'tool_choice.name' {name!r} is not in 'tools'",
                             "tool_choice")
        return ToolChoice("required", name)

    async def count_tokens(self, request: Request):
        s = self.server
        try:
            body = await s.body(request)
            s.ready()
            refuse_unknown(body, COUNT_FIELDS, "count_tokens")
            check_agent_fields(body)
            s.model_name(body, required=True)
            prompt = await asyncio.to_thread(
                lambda: render(s.tokenizer, self._conversation(body), self._tools(body),
                               thinking_args(s, body)))
        except BadRequest as e:
            return error(e.message, e.status)
        return JSONResponse({"input_tokens": len(prompt)})

    async def messages(self, request: Request):
        return await self.server.respond(request, self.parse, MessageView,
                                         lambda message, status, param: error(message,
                                                                              status))


def _or(value, default):
    return default if value is None else value


class MessageView:
    """One request's events as a Message, or as the stream of events Anthropic's SDK reads."""

    def __init__(self, job, delivery: MessagesDelivery, reply: Reply):
        self.job, self.delivery, self.reply = job, delivery, reply
        self.block = None  # the kind of the open content block
        self.index = -1
        self.generated = 0

    def _message(self, content: list, stop_reason, usage: dict) -> dict:
        return {"id": self.job.id, "type": "message", "role": "assistant",
                "model": self.delivery.model, "content": content, "stop_reason": stop_reason,
                "stop_sequence": self.job.stop_hit, "usage": usage}

    @staticmethod
    def _usage(last: dict) -> dict:
        return {"input_tokens": last["prompt_tokens"], "output_tokens":
                last["completion_tokens"], "cache_read_input_tokens": last["cached_tokens"],
                "cache_creation_input_tokens": 0}

    @staticmethod
    def _tool_use(call: dict) -> dict:
        return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                "name": call["function"]["name"],
                "input": arguments_object(call)}

    def _stop_reason(self, finish: str) -> str:
        reason = STOP[self.reply.finish_reason(finish)]
        if reason == "max_tokens" and self.delivery.window_bound:
            return WINDOW_EXCEEDED
        return "stop_sequence" if reason == "end_turn" and self.job.stop_hit else reason

    def whole(self, result: Result) -> dict:
        last = result.last
        content, reasoning, calls = self.reply.feed(result.text, final=True)
        blocks = []
        if reasoning:
            blocks.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        if content:
            blocks.append({"type": "text", "text": content})
        blocks += [self._tool_use(c) for c in calls]
        return self._message(blocks, self._stop_reason(last["finish_reason"]),
                             self._usage(last))

    # -- streaming -----------------------------------------------------------------------
    def chunks(self, event: dict):
        if event["type"] == "error":
            yield _sse({"type": "error", "error": {"type": "api_error",
                                                   "message": public(event["message"])}},
                       "error")
            return
        if self.index < 0:
            self.index = 0
            # the prompt is prefilled by now: what came from the prompt cache is known
            start = self._message([], None, {"input_tokens": len(self.job.prompt),
                                             "output_tokens": 0,
                                             "cache_read_input_tokens": self.job.cached_tokens,
                                             "cache_creation_input_tokens": 0})
            yield _sse({"type": "message_start", "message": start}, "message_start")
        if event["type"] == "token":
            self.generated += 1
            yield from self._pieces(*self.reply.feed(event["text"]))
            return
        yield from self._pieces(*self.reply.feed("", final=True))
        yield from self._close()
        yield _sse({"type": "message_delta",
                    "delta": {"stop_reason": self._stop_reason(event["finish_reason"]),
                              "stop_sequence": self.job.stop_hit},
                    "usage": self._usage(event)}, "message_delta")
        yield _sse({"type": "message_stop"}, "message_stop")

    def _pieces(self, content: str, reasoning: str, calls: List[dict]):
        if reasoning:
            yield from self._open("thinking", {"type": "thinking", "thinking": ""})
            yield self._delta({"type": "thinking_delta", "thinking": reasoning})
        if content:
            yield from self._open("text", {"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": content})
        for call in calls:
            use = self._tool_use(call)
            yield from self._open("tool_use", {**use, "input": {}}, always=True)
            yield self._delta({"type": "input_json_delta",
                               "partial_json": json.dumps(use["input"], ensure_ascii=False)})

    def _open(self, kind: str, block: dict, always: bool = False):
        if self.block == kind and not always:
            return
        yield from self._close()
        self.block = kind
        yield _sse({"type": "content_block_start", "index": self.index,
                    "content_block": block}, "content_block_start")

    def _close(self):
        if self.block is not None:
            yield _sse({"type": "content_block_stop", "index": self.index},
                       "content_block_stop")
            self.block = None
            self.index += 1

    def _delta(self, delta: dict) -> str:
        return _sse({"type": "content_block_delta", "index": self.index, "delta": delta},
                    "content_block_delta")
