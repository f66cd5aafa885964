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
import re
import uuid
from typing import Any, Dict, List, Optional, Tuple

from mlx_lm.generate import TextStateMachine, make_text_state_machine
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer

from .errors import BadRequest
from .templates import bounded_render, check_client_args, forget_compiled_templates

log = logging.getLogger("edgemoe.server")


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


def no_tool_format(tokenizer) -> str:
    return ("this model's chat template has no tool-call format mlx-lm can read (no "
            "tool parser), so calls it wrote on its own could not be returned: force one "
            "(tool_choice \"required\" or a named function), send tool_choice \"none\", or "
            "start the server with a --chat-template that has tools")


def render(tokenizer, messages: List[dict], tools: Optional[list] = None,
           template_args: Optional[dict] = None, role_mapping=None) -> List[int]:
    """The prompt's tokens: the chat template's rendering of `messages` with `tools`."""
    if not tokenizer.has_chat_template:
        if tools:
            raise BadRequest("this model has no chat template, so it cannot be given tools",
                             "tools")
        from mlx_lm.server import convert_chat
        return tokenizer.encode(convert_chat(messages, role_mapping))
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
    finally:
        if (template_args or {}).get("chat_template") is not None:
            forget_compiled_templates()  # what its compiled constants hold
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
                 parse_tools: bool = True, forced: bool = False,
                 max_calls: Optional[int] = None):
        """`forced`: the whole reply is one call a grammar forced (constrain.forced_call),
        read here whatever the model's own parser; `max_calls`: the most calls returned
        (1 for parallel_tool_calls: false)."""
        self.tools = tools
        self.forced = tokenizer if forced else None
        self.max_calls = max_calls
        self.markers = (tokenizer.tool_call_start or "", tokenizer.tool_call_end or "")
        self.parser = tokenizer.tool_parser if (tools and parse_tools and not forced) \
            else None
        machine = make_text_state_machine(tokenizer) if (
            tokenizer.has_thinking or self.parser is not None) else None
        self.machine = machine.make_state(initial_state(tokenizer, prompt)) if machine \
            else None
        self.state = self.machine[0] if machine else "normal"
        self.tool_text = ""
        self.calls: List[dict] = []  # parsed, in OpenAI's form
        self.content, self.reasoning = [], []

    def feed(self, text: str, final: bool = False) -> Tuple[str, str, List[dict]]:
        if self.forced is not None:  # nothing is certain until the call is whole
            self.tool_text += text
            if not final:
                return "", "", []
            calls = [forced_reply_call(self.tool_text, self.forced.tool_call_start,
                                       self.forced.tool_call_end)]
            if calls[0] is None and len(self.tools or ()) == 1:  # cut before its name
                calls = [new_call(self.tools[0]["function"]["name"], "")]
            self.tool_text = ""
            calls = self._room([c for c in calls if c is not None])
            self.calls += calls
            return "", "", calls
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
            elif self.state == "tool":  # the call's end marker: it is complete
                parsed, unparsed = self._parse()
                calls += parsed
                content.append(unparsed)
            if state == "reasoning":
                reasoning.append(piece)
            elif state in ("normal", None):
                content.append(piece)
            self.state = state
        if final and self.tool_text:
            parsed, unparsed = self._parse(cut=True)  # cut off before its end marker
            calls += parsed
            content.append(unparsed)
        content, reasoning = "".join(content), "".join(reasoning)
        calls = self._room(calls)
        self.content.append(content)
        self.reasoning.append(reasoning)
        self.calls += calls
        return content, reasoning, calls

    def _room(self, calls: List[dict]) -> List[dict]:
        if self.max_calls is None:
            return calls
        return calls[:max(0, self.max_calls - len(self.calls))]

    def _parse(self, cut: bool = False) -> Tuple[List[dict], str]:
        """The calls in the tool text, and the text of a call that did not parse (given
        back as content, never dropped): a call cut by max_tokens is returned as far as
        it goes (its name, its arguments' JSON so far)."""
        text, self.tool_text = self.tool_text, ""
        if not text.strip():
            return [], ""
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError) as e:  # json.JSONDecodeError is a ValueError
            partial = partial_call(text) if cut else None
            if partial is not None:
                return [partial], ""
            log.warning("a tool call did not parse (%s: %s): %r", type(e).__name__, e,
                        text[:200])
            start, end = self.markers
            return [], start + text + ("" if cut else end)
        return [new_call(c["name"], c.get("arguments", {}))
                for c in (parsed if isinstance(parsed, list) else [parsed])], ""

    def finish_reason(self, reason: str) -> str:
        return "tool_calls" if self.calls and reason == "stop" else reason


def new_call(name: str, arguments) -> dict:
    """A call in OpenAI's form: its arguments a JSON string (as far as they go, for a
    call cut by max_tokens)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


_PARTIAL_CALL = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"?\s*'
                           r'(?:,\s*"arguments"\s*:\s*(.*))?', re.DOTALL)


def partial_call(text: str) -> Optional[dict]:
    """A JSON call {"name": ..., "arguments": ...} cut short, as far as it goes, or None
    when not even its name began."""
    m = _PARTIAL_CALL.match(text)
    if m is None:
        return None
    return new_call(json.loads('"' + m.group(1).rstrip("\\") + '"'), m.group(2) or "")


def forced_reply_call(text: str, start: Optional[str], end: Optional[str]
                      ) -> Optional[dict]:
    """The call of a reply a grammar forced: `start`{"name": ..., "arguments": ...}`end`
    (the markers where the model's tool format has them), whole or cut short."""
    body = text.strip()
    if start and body.startswith(start):
        body = body[len(start):]
    try:  # a whole object, whatever follows it (an end marker, or part of one)
        call, _ = json.JSONDecoder().raw_decode(body.lstrip())
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            return new_call(call["name"], call.get("arguments", {}))
    except json.JSONDecodeError:
        pass
    return partial_call(body)


def arguments_object(call: dict) -> dict:
    """A call's arguments as an object (Anthropic's input, Ollama's arguments): those of
    a call cut short closed as far as they parse, else {}."""
    text = call["function"]["arguments"]
    try:
        value = json.loads(text)
        return value if isinstance(value, dict) else {}
    except json.JSONDecodeError:
        return close_json(text)


def close_json(text: str) -> dict:
    """The object a JSON text cut short begins: its open strings, arrays and objects
    closed, after dropping what cannot end a value (a dangling key, comma or colon)."""
    for cut in range(len(text), max(-1, len(text) - 64), -1):
        head = text[:cut].rstrip().rstrip(",:").rstrip()
        closers, in_string, escaped = [], False, False
        for ch in head:
            if in_string:
                escaped = ch == "\\" and not escaped
                in_string = escaped or ch != '"'
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                closers.append("}" if ch == "{" else "]")
            elif ch in "}]" and closers:
                closers.pop()
        tail = ('"' if in_string and not escaped else "") + "".join(reversed(closers))
        try:
            value = json.loads(head + tail)
            return value if isinstance(value, dict) else {}
        except json.JSONDecodeError:
            continue
    return {}


class _KeepSpaceBPE(BPEStreamingDetokenizer):
    """mlx-lm's byte-level detokenizer without its trim of the first leading space."""

    def _maybe_trim_space(self, current_text):
        return current_text


def untrimmed_detokenizer(tokenizer):
    """A streaming detokenizer whose text is exactly its tokens' (a completion's first
    token keeps its leading space: prompt + completion is the text the model wrote)."""
    detokenizer = tokenizer.detokenizer
    if isinstance(detokenizer, BPEStreamingDetokenizer):
        keep = _KeepSpaceBPE.__new__(_KeepSpaceBPE)
        keep.__dict__.update(detokenizer.__dict__)
        return keep
    if isinstance(detokenizer, SPMStreamingDetokenizer):
        detokenizer.trim_space = False
    return detokenizer


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
