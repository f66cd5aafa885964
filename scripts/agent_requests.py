"""Coding agents' recorded requests (tests/data/agents): read, and cut to fit a context.

Shared by tests/test_agents.py and scripts/bench_prompt_cache.py."""

import gzip
import inspect
import json
from pathlib import Path

AGENTS = Path(__file__).resolve().parent.parent / "tests" / "data" / "agents"
CALLED = {"Bash", "exec_command"}  # the tools the recorded sessions call
TEXT_KEYS = ("text", "description", "content", "output", "system", "instructions")


def recorded(name: str):
    with gzip.open(AGENTS / name, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def claude_code():
    return recorded("claude_code-2.1.332.jsonl.gz")


def claude_code_counts():
    return recorded("claude_code-2.1.332-count_tokens.jsonl.gz")


def codex():
    return recorded("codex-0.171.0.jsonl.gz")


def shorten(value, chars: int):
    """Every string under a text-bearing key cut to `chars`; the rest as it is."""
    if isinstance(value, list):
        return [shorten(v, chars) for v in value]
    if isinstance(value, dict):
        return {k: (v[:chars] if isinstance(v, str) and k in TEXT_KEYS
                    else shorten(v, chars)) for k, v in value.items()}
    return value


def fit(body: dict, chars: int = 20, max_tokens: int = 4) -> dict:
    """A recorded body cut to fit the bundled model's context: the tools the session
    calls, and the hosted ones (the server drops those), long texts cut to `chars`;
    every field, message, block and tool kind as recorded."""
    tools = [t for t in body["tools"]
             if t.get("name") in CALLED or t.get("type", "function") != "function"]
    out = shorten({**body, "tools": tools}, chars)
    if "max_tokens" in out:
        out["max_tokens"] = max_tokens
    return out


def split(body: dict, create) -> tuple:
    """(the arguments a client library's `create` takes, the rest as extra_body): each
    body is sent as recorded, whatever the library's version knows."""
    known = set(inspect.signature(create).parameters)
    return ({k: v for k, v in body.items() if k in known and k != "stream"},
            {k: v for k, v in body.items() if k not in known and k != "stream"})
