"""Reading a request's fields, as every API reads them: each checked for its type and range,
a field this server does not implement refused by name, a field sent as null absent.

Also what OpenAI's two APIs (chat completions and Responses) share about their fields."""

import json
import math
from typing import List, Optional

from .canonical import ToolChoice
from .constrain import Grammar, GrammarError
from .errors import BadRequest

NUMBER = (int, float)
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
MAX_TOP_LOGPROBS = 20  # OpenAI's limit
MAX_DRAFT_TOKENS = 64  # a window's drafts a request may ask for
# OpenAI's fields that cannot change a result here: who asks (user, safety_identifier),
# billing and routing on OpenAI's side (service_tier, prompt_cache_key, store, metadata)
NO_EFFECT = {"user", "service_tier", "prompt_cache_key", "safety_identifier", "metadata",
             "store"}


def field(body: dict, name: str, types, default=None, lo=None, hi=None, where: str = ""):
    """body[name], checked: its type, finite, within [lo, hi]; `default` when absent or
    null. `where` prefixes the name in messages (e.g. "options.")."""
    value = body.get(name, default)
    if value is None:
        return default
    label = where + name
    names = types if isinstance(types, tuple) else (types,)
    # bool is an int in Python; a JSON true is never a valid number here
    if not isinstance(value, names) or (isinstance(value, bool) and bool not in names):
        expected = " or ".join({"int": "integer", "float": "number", "str": "string",
                                "bool": "boolean", "list": "array", "dict": "object"}
                               .get(t.__name__, t.__name__) for t in names)
        raise BadRequest(f"'{label}' must be {'an' if expected[0] in 'aeiou' else 'a'} "
                         f"{expected}, got {type(value).__name__} {json.dumps(value)[:60]}",
                         label)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{label}' must be a finite number, got {value}", label)
    if lo is not None and value < lo:
        raise BadRequest(f"'{label}' must be at least {lo}, got {value}", label)
    if hi is not None and value > hi:
        raise BadRequest(f"'{label}' must be at most {hi}, got {value}", label)
    return value


def refuse_unknown(body: dict, known, what: str, where: str = ""):
    """A 400 naming the first field this server does not implement: never a silent 200.
    A field sent as null is absent (clients built on typed models send every field)."""
    unknown = sorted(k for k in body if k not in known and body[k] is not None)
    if unknown:
        raise BadRequest(f"'{where}{unknown[0]}' is not supported by {what} on this server "
                         f"(supported: {', '.join(sorted(known))})", where + unknown[0])


def stop_strings(value, name: str = "stop") -> List[str]:
    stop = [value] if isinstance(value, str) else (value or [])
    if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
        raise BadRequest(f"'{name}' must be a string or an array of non-empty strings", name)
    if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"'{name}' takes at most {MAX_STOP_STRINGS} strings of at most "
                         f"{MAX_STOP_CHARS} characters, got {len(stop)} (longest "
                         f"{max(map(len, stop))})", name)
    return stop


def check_reasoning_effort(server, body: dict, name: str = "reasoning_effort"):
    """Accepted for a model that does not reason (it changes nothing); a reasoning
    model's thinking is switched by chat_template_kwargs (enable_thinking) instead."""
    effort = body.get(name)
    if effort is not None and server.tokenizer.has_thinking:
        raise BadRequest(f"'{name}' is not supported: this model's thinking is switched by "
                         f"chat_template_kwargs {{\"enable_thinking\": false}}", name)


def response_format_grammar(server, fmt: Optional[dict]):
    """The grammar of an OpenAI response_format ({"type": "text" | "json_object" |
    "json_schema", "json_schema": {"name": ..., "schema": {...}}}), or None."""
    if fmt is None:
        return None
    kind, grammar = fmt.get("type"), None
    try:
        if kind == "json_object":
            grammar = Grammar.json(server.grammar_tokens())
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not (isinstance(spec, dict) and isinstance(spec.get("schema", {}), dict)):
                raise BadRequest("'response_format.json_schema' must be "
                                 "{\"name\": ..., \"schema\": {...}}", "response_format")
            grammar = Grammar.json(server.grammar_tokens(), spec.get("schema"))
        elif kind != "text":
            raise BadRequest(f"'response_format.type' must be text, json_object or "
                             f"json_schema, got {kind!r}", "response_format")
    except GrammarError as e:
        raise BadRequest(f"'response_format' schema: {e}", "response_format") from None
    if grammar is not None:
        grammar.param = "response_format"
    return grammar


def tool_choice(choice, tools: Optional[list], function_name) -> ToolChoice:
    """OpenAI's tool_choice, as both its APIs take it: none, auto, required or a function,
    whose name `function_name(choice)` reads from the API's own form (or refuses)."""
    if choice in (None, "auto", "none"):
        return ToolChoice(choice or "auto")
    name = function_name(choice) if isinstance(choice, dict) else None
    if name is None and choice != "required":
        raise BadRequest(f"'tool_choice' must be none, auto, required or a function, "
                         f"got {choice!r}", "tool_choice")
    if not tools:
        raise BadRequest("'tool_choice' asks for a tool call, but no 'tools' are given",
                         "tool_choice")
    if name is not None and name not in [t["function"]["name"] for t in tools]:
        raise BadRequest(f"'tool_choice' names {name!r}, which is not in 'tools'",
                         "tool_choice")
    return ToolChoice("required", name)
