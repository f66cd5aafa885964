"""Constrained decoding: tokens that must follow a grammar (JSON, a JSON schema, a tool call).

`response_format` ({"type": "json_object"} or {"type": "json_schema", ...}) and a tool
choice that forces a call are grammars; llguidance (Microsoft's grammar engine, the one
llama.cpp and vLLM use) compiles them against the tokenizer and gives, at each step, the
tokens that may come next. The engine masks every other token out of the row's logits
(`Grammar.mask`) and tells the grammar what was chosen (`Grammar.accept`); a grammar that
is complete ends the request.
"""

import asyncio
import contextlib
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Optional

import mlx.core as mx
import numpy as np

from .errors import BadRequest
from .limits import give_memory_back

# JSON as a model writes it: no whitespace but one space after ',' and ':', so that a
# small or unsure model cannot spend its tokens on newlines
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A grammar that does not compile (an unsupported or invalid schema)."""


@contextlib.contextmanager
def compiling():
    """A schema llguidance (or Python's json) cannot take, as a GrammarError: llguidance
    raises ValueError past its recursion limit (a schema ~200 levels deep), json.dumps
    RecursionError past Python's (~1000)."""
    try:
        yield
    except RecursionError:
        raise GrammarError("the schema is nested too deeply (past Python's recursion "
                           "limit)") from None
    except ValueError as e:
        raise GrammarError(str(e)[:300]) from None


class Tokens:
    """The tokenizer as llguidance sees it (made once per model: about 50 ms)."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.ll = llguidance.hf.from_tokenizer(tokenizer._tokenizer, n_vocab=vocab_size,
                                               eos_token=list(tokenizer.eos_token_ids))
        self.vocab_size = vocab_size


# A grammar's masks are computed on these threads (llguidance drops the GIL), while the
# engine runs the model's forward pass: a costly grammar delays its batch only by what
# its mask takes past the forward, and at most by these budgets, past which its row fails
# alone (a schema regex like ^(a{700}){700}$ costs ~0.15 s a token, its first 1.5 s).
# llguidance's own fuel limits do not bound that time (measured: 50k step fuel, 5k lexer
# states or 5k items a step leave it as slow).
# They run at a lower priority than the engine where the OS allows a thread its own
# (Linux): a costly mask, which goes on after its row failed (llguidance cannot be
# stopped), then takes only a core the model leaves idle.
MASK_NICE = 10


def lower_priority():
    if sys.platform == "linux":  # a thread's id is its own scheduling entity there only
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MASK_NICE)
        except OSError:
            pass


MASK_THREADS = ThreadPoolExecutor(max_workers=64, thread_name_prefix="edgemoe-grammar",
                                  initializer=lower_priority)
# Before a grammar's request joins a batch, one thread (at the same lower priority)
# computes its first mask, the costly one (llguidance builds its lexer there): grammars
# sent at once queue behind each other there rather than beside the model (15 bombs on
# 15 threads stretched 4 completions 4.45 -> 17.9 s on 2 cores), and one whose first
# mask costs over FIRST_MASK_CPU_S of its thread's CPU (^(a{700}){700}$: ~0.3 s; an
# ordinary schema's: under 1 ms) is refused with a 400 before it can meet anything in a
# batch (it once met an expert read's failure there and ended as a 500). CPU time, not
# wall time: a loaded machine must not refuse a good grammar.
VETTING = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgemoe-grammar-vet",
                             initializer=lower_priority)
FIRST_MASK_CPU_S = 0.1
VET_WAIT_S = 60.0  # the most a request waits for its turn and its first mask: then a 503
# llguidance's regex fuel (its default 1M): a schema regex like ^(a{700}){700}$ burns
# 14 s and ~185 MB in its first mask at 1M, and stops with a lexer error in ~1 s at 300k;
# formats (email, uri, date-time, uuid, ipv6), patterns and long strings need far less
LEXER_FUEL = 300_000
MASK_STEP_S = 0.2  # the most a step waits for one row's mask once its forward is done
MASK_TOTAL_S = 1.0  # the most one row's grammar makes its batch wait in all


class GrammarTooSlow(GrammarError):
    """A grammar whose masks took longer than its budget: its row fails alone."""


class Grammar:
    """One request's position in its grammar."""

    param = None  # the request field that asked for it (named in a row's error)

    def __init__(self, tokens: Tokens, grammar: str):
        import llguidance

        self.vocab_size = tokens.vocab_size
        self.matcher = llguidance.LLMatcher(tokens.ll, grammar, limits=llguidance.LLParserLimits(
            initial_lexer_fuel=LEXER_FUEL))
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error())
        self.next_mask: Optional[Future] = None  # the next step's bits, being computed
        self.waited = 0.0  # seconds its batch waited for its masks past the forward
        self.abandoned = False  # its row failed while a mask was being computed

    @classmethod
    def json(cls, tokens: Tokens, schema: Optional[dict] = None) -> "Grammar":
        """Any JSON object, or one that follows `schema`."""
        import llguidance

        schema = {"type": "object"} if schema is None else schema
        with compiling():
            grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                    defaults=JSON_STYLE)
        return cls(tokens, grammar)

    @classmethod
    def lark(cls, tokens: Tokens, grammar: str) -> "Grammar":
        import llguidance

        with compiling():
            grammar = llguidance.LLMatcher.grammar_from_lark(grammar)
        return cls(tokens, grammar)

    def first_mask(self) -> bytes:
        """The first step's mask, computed here (on VETTING); GrammarError when the
        grammar fails there or costs over FIRST_MASK_CPU_S of CPU."""
        tic = time.thread_time()
        bits = self.matcher.compute_bitmask()
        cpu_s = time.thread_time() - tic
        if self.matcher.is_error():
            raise GrammarError(self.matcher.get_error()[:300])
        if cpu_s > FIRST_MASK_CPU_S:
            self._drop()
            raise GrammarTooSlow(f"its grammar took {cpu_s:.2f} s of CPU to find the first "
                                 f"tokens allowed (at most {FIRST_MASK_CPU_S:g} s): "
                                 f"simplify its schema or pattern")
        return bits

    def prefetch(self):
        """Start computing the next step's mask on a grammar thread."""
        if self.next_mask is None:
            self.next_mask = MASK_THREADS.submit(self._compute)

    def _compute(self) -> bytes:
        """One mask (on a grammar thread); a mask its row gave up on frees its matcher
        and gives the memory back as it ends (a bomb's lexer holds ~185 MB)."""
        try:
            return self.matcher.compute_bitmask()
        finally:
            if self.abandoned:
                self._drop()

    def _drop(self):
        self.matcher = None
        give_memory_back()

    def bits(self, since: Optional[float]) -> bytes:
        """The next step's mask; with `since` (when the step's forward ended) waited
        for within the budgets, past which GrammarTooSlow (its computation is left
        to end on its thread: llguidance cannot be stopped)."""
        self.prefetch()
        future, self.next_mask = self.next_mask, None
        if since is None or future.done():
            return future.result()
        budget = min(MASK_STEP_S, MASK_TOTAL_S - self.waited)
        tic = time.perf_counter()
        try:
            return future.result(timeout=max(0.0, since + budget - tic))
        except FutureTimeout:
            self.abandoned = True
            if future.cancel() or future.done():  # else _compute drops it as it ends
                self._drop()
            raise GrammarTooSlow(
                f"its grammar took over {MASK_STEP_S:g} s to find the tokens allowed next "
                f"(or over {MASK_TOTAL_S:g} s of waits in all): simplify its schema or "
                f"pattern") from None
        finally:
            self.waited += time.perf_counter() - tic

    def mask(self, logits: mx.array, since: Optional[float] = None) -> mx.array:
        """`logits` (1, vocab) with every token the grammar forbids at -inf (`since`:
        see `bits`)."""
        words = np.frombuffer(self.bits(since), dtype=np.uint8)
        if self.matcher.is_error():  # e.g. past llguidance's limits at this step
            raise GrammarError(self.matcher.get_error()[:300])
        allowed = np.unpackbits(words, bitorder="little")[:logits.shape[-1]].astype(bool)
        if not allowed.any():  # else every logit at -inf: a server error, not a 400
            raise GrammarError("its grammar allows no token at this step")
        if allowed.size < logits.shape[-1]:  # ids past the tokenizer's: never allowed
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.size))
        return mx.where(mx.array(allowed)[None], logits, -mx.inf)

    def accept(self, token: int) -> bool:
        """Move past `token`; True when the grammar is complete (nothing may follow)."""
        if not self.matcher.consume_token(token):
            raise GrammarError(f"token {token} does not follow the grammar: "
                               f"{self.matcher.get_error()}")
        return self.matcher.is_stopped()


async def vetted(grammar: Grammar):
    """`grammar` with its first mask computed on VETTING, ready for a batch; BadRequest
    naming its field (grammar.param) when it fails there, a 503 when VETTING is backed
    up past VET_WAIT_S."""
    future = VETTING.submit(grammar.first_mask)
    try:
        bits = await asyncio.wait_for(asyncio.wrap_future(future), VET_WAIT_S)
    except asyncio.TimeoutError:
        raise BadRequest(f"the server's grammar thread is busy (over {VET_WAIT_S:g} s); "
                         f"try again later", status=503) from None
    except GrammarError as e:
        raise BadRequest(f"'{grammar.param}': {e}", grammar.param) from None
    grammar.next_mask = Future()
    grammar.next_mask.set_result(bits)


MAX_OPEN_PROPERTIES = 16  # the keys a call may give an object whose schema lists none


def tool_call_grammar(start: str, end: str, tools: list, name: Optional[str]) -> str:
    """A Lark grammar for one JSON tool call, {"name": ..., "arguments": {...}}, of the
    tool `name` or of any of `tools`, between the tool parser's markers `start` and `end`
    (none where the model has no JSON tool format: the reply is the call alone).
    Parameter schemas are closed (generation_schema), so the call always ends."""
    calls = [{"type": "object",
              "properties": {"name": {"const": t["function"]["name"]},
                             "arguments": generation_schema(
                                 t["function"].get("parameters") or {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False}
             for t in tools if name is None or t["function"]["name"] == name]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = JSON_STYLE
    markers = [json.dumps(m) for m in (start, end) if m]
    body = f"{markers[0]} call {markers[1]}" if len(markers) == 2 else "call"
    return f"start: {body}\ncall: %json {json.dumps(schema)}\n"


_SCHEMAS = ("items", "not", "additionalProperties", "contains", "if", "then", "else")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def forced_call(server, tools: list, name: Optional[str]):
    """The grammar of one call of tool `name` (or of any of `tools`): between the tool
    parser's markers where the model writes JSON calls (mlx-lm's json_tools), else the
    call's JSON alone; either way the reply is read as that call (Reply(forced=True)),
    with or without a parser. `server`: the http.Server (its tokenizer and grammar tokens)."""
    tok = server.tokenizer
    json_calls = tok.tool_parser is not None and \
        tok.tool_parser.__module__.endswith(".json_tools")
    start, end = (tok.tool_call_start, tok.tool_call_end) if json_calls else ("", "")
    try:
        with compiling():  # generation_schema recurses as deep as the schemas
            grammar = tool_call_grammar(start, end, tools, name)
        forced = Grammar.lark(server.grammar_tokens(), grammar)
        forced.param = "tool_choice"
        return forced
    except GrammarError as e:
        raise BadRequest(f"a tool's parameters schema: {e}", "tools") from None


def generation_schema(schema):
    """`schema` as generation follows it: an object that lists its properties and says
    nothing of others takes no others (`additionalProperties: false`, as OpenAI's strict
    mode has it), and one that lists none takes at most MAX_OPEN_PROPERTIES keys. JSON
    Schema's default (any other key) lets a grammar go on adding keys until max_tokens,
    which ordinary tool schemas (LangChain's, MCP's) leave open."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = generation_schema(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [generation_schema(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {k: generation_schema(s) for k, s in out[key].items()}
    is_object = out.get("type") == "object" or (
        isinstance(out.get("type"), list) and "object" in out["type"]) or "properties" in out
    if is_object and "additionalProperties" not in out and "patternProperties" not in out:
        if out.get("properties"):
            out["additionalProperties"] = False
        else:
            out.setdefault("maxProperties", MAX_OPEN_PROPERTIES)
    return out
