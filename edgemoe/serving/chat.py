"""What every API shares about a conversation: messages in, the prompt's tokens out, and the
reply split into text, reasoning and tool calls.

Prompts are rendered by the model's own chat template (with the request's tools), as
mlx_lm.server renders them. Replies are split by mlx-lm's own `TextStateMachine` on the
markers the tokenizer knows (`<think>`, the tool parser's call markers), and tool calls
parsed by the tokenizer's tool parser (mlx_lm.tool_parsers), so a model mlx-lm can call
tools with calls tools here the same way.
"""

import json
import logging
import uuid
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine

log = logging.getLogger("edgemoe.server")


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (OpenAI's
    {"type": "text", "text": ...}, Anthropic's too)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"{where}: only text content parts are supported, got "
                                 f"{kind!r}", "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: 'content' must be a string or a list of text parts",
                     "messages")


def tool_call_message(calls: list, where: str) -> List[dict]:
    """Tool calls of an assistant message, arguments as objects (what chat templates
    iterate over), from OpenAI's form with arguments as a JSON string."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}: 'tool_calls' must be an array", "messages")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise BadRequest(f"{where}.tool_calls[{j}] must be {{\"type\": \"function\", "
                             f"\"function\": {{\"name\": ..., \"arguments\": ...}}}}",
                             "messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as e:
                raise BadRequest(f"{where}.tool_calls[{j}].function.arguments is not JSON: "
                                 f"{e}", "messages") from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def check_tools(tools: Any, param: str = "tools") -> Optional[list]:
    """OpenAI-style tools ([{"type": "function", "function": {"name", "parameters"}}])."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise BadRequest(f"'{param}' must be an array of tools", param)
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not (isinstance(t, dict) and t.get("type", "function") == "function"
                and isinstance(fn, dict) and isinstance(fn.get("name"), str)):
            raise BadRequest(f"'{param}[{i}]' must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": ..., \"parameters\": {{...}}}}}}", param)
        if not isinstance(fn.get("parameters", {}), dict):
            raise BadRequest(f"'{param}[{i}].function.parameters' must be a JSON schema "
                             f"object", param)
    return tools or None


def render(tokenizer, messages: List[dict], tools: Optional[list] = None,
           template_args: Optional[dict] = None, role_mapping=None) -> List[int]:
    """The prompt's tokens: the chat template's rendering of `messages` with `tools`."""
    if not tokenizer.has_chat_template:
        if tools:
            raise BadRequest("this model has no chat template, so it cannot be given tools",
                             "tools")
        from mlx_lm.server import convert_chat
        return tokenizer.encode(convert_chat(messages, role_mapping))
    from .templates import bounded_render, check_client_args

    check_client_args(template_args or {})
    try:  # bounded in time and size (edgemoe.serving.templates)
        text = bounded_render(lambda: tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=True,
            **(template_args or {})))
    except BadRequest:
        raise
    except Exception as e:  # jinja's own message names what the template wanted
        raise BadRequest(f"the chat template cannot render these messages: "
                         f"{type(e).__name__}: {e}", "messages") from None
    return tokenizer.encode(text, add_special_tokens=False)


def initial_state(tokenizer, prompt: List[int]) -> str:
    """'reasoning' when the prompt ends inside a think block the template opened."""
    if tokenizer.has_thinking and \
            tokenizer.rfind_think_start(prompt) > tokenizer.rfind_think_end(prompt):
        return "reasoning"
    return tokenizer.response_initial_state or "normal"


class Reply:
    """A reply as it is generated: its text split into content, reasoning and tool calls.

    `feed(text)` takes each piece the engine releases and returns what became certain
    (content, reasoning, finished tool calls); `close()` at the end flushes the rest.
    """

    def __init__(self, tokenizer, prompt: List[int], tools: Optional[list],
                 parse_tools: bool = True):
        self.tools = tools
        self.parser = tokenizer.tool_parser if (tools and parse_tools) else None
        machine = make_text_state_machine(tokenizer) if (
            tokenizer.has_thinking or self.parser is not None) else None
        self.machine = machine.make_state(initial_state(tokenizer, prompt)) if machine \
            else None
        self.state = self.machine[0] if machine else "normal"
        self.tool_text = ""
        self.calls: List[dict] = []  # parsed, in OpenAI's form
        self.content, self.reasoning = [], []

    def feed(self, text: str, final: bool = False) -> Tuple[str, str, List[dict]]:
        if self.machine is None:
            self.content.append(text)
            return text, "", []
        self.machine, segments = TextStateMachine.split(self.machine, text)
        if final:
            self.machine, rest, state = TextStateMachine.flush(self.machine)
            segments.append((state, rest))
        content, reasoning, calls = [], [], []
        for state, piece in segments:
            if state == "tool":
                self.tool_text += piece
            elif self.state == "tool":
                calls += self._parse()  # the call's end marker: it is complete
            if state == "reasoning":
                reasoning.append(piece)
            elif state in ("normal", None):
                content.append(piece)
            self.state = state
        if final and self.tool_text:
            calls += self._parse()  # cut off before its end marker
        content, reasoning = "".join(content), "".join(reasoning)
        self.content.append(content)
        self.reasoning.append(reasoning)
        self.calls += calls
        return content, reasoning, calls

    def _parse(self) -> List[dict]:
        text, self.tool_text = self.tool_text, ""
        if not text.strip():
            return []
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            log.warning("a tool call did not parse (%s: %s): %r", type(e).__name__, e,
                        text[:200])
            return []
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": c["name"],
                              "arguments": json.dumps(c.get("arguments", {}),
                                                      ensure_ascii=False)}}
                for c in (parsed if isinstance(parsed, list) else [parsed])]

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason


def token_pieces(tokenizer, ids: List[int]) -> List[Tuple[str, List[int]]]:
    """Each token as OpenAI reports it: its text and its UTF-8 bytes (a byte-level BPE
    token may hold part of a character: its bytes are exact, its text has U+FFFD)."""
    raw = tokenizer.convert_ids_to_tokens(ids)
    decoder = _byte_decoder(tokenizer)
    out = []
    for i, piece in zip(ids, raw):
        if piece is None:
            data = b""
        elif decoder is not None and all(ch in decoder for ch in piece):
            data = bytes(decoder[ch] for ch in piece)
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
            data = bytes([int(piece[3:5], 16)])  # sentencepiece byte fallback
        else:
            data = tokenizer.decode([i]).encode("utf-8")
        out.append((data.decode("utf-8", errors="replace"), list(data)))
    return out


def _byte_decoder(tokenizer) -> Optional[Dict[str, int]]:
    """Byte-level BPE's map from its printable stand-ins to bytes (GPT-2's), or None."""
    from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, _byte_decoder

    return _byte_decoder() if isinstance(tokenizer.detokenizer, BPEStreamingDetokenizer) \
        else None
