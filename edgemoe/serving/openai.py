"""OpenAI's API (and mlx_lm.server's extensions of it): chat completions, completions, models.

Every field OpenAI defines is implemented, accepted where it cannot change the result here
(docs/server-fields.md has the table), or refused with a 400 naming it; a field sent as
null is absent. mlx_lm.server's extra fields (top_k, min_p, repetition_penalty and the
penalties' context sizes, chat_template_kwargs, role_mapping, num_draft_tokens) are taken
as it takes them.

Tools work on any model: a forced call (tool_choice "required" or a named function) is
decoded under a grammar and read here whatever the model's tool format; `auto` needs the
tool parser mlx-lm infers from the chat template; `none` needs nothing.
"""

import asyncio
from typing import Any, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .. import __version__
from .chat import (Reply, check_tools, no_tool_format, render, text_of, token_pieces,
                   tool_call_message, untrimmed_detokenizer)
from .constrain import Grammar, GrammarError, forced_call
from .errors import BadRequest
from .http import (MAX_TOP_LOGPROBS, NUMBER, ClientGone, Server, error_response,
                   event_stream, field, public, refuse_unknown, sse, stop_strings)

# fields that cannot change a result here: who asks (user, safety_identifier), billing and
# routing on OpenAI's side (service_tier, prompt_cache_key, store, metadata)
NO_EFFECT = {"user", "service_tier", "prompt_cache_key", "safety_identifier", "metadata",
             "store"}
COMMON = {"model", "stream", "stream_options", "n", "temperature", "top_p", "top_k",
          "min_p", "seed", "stop", "max_tokens", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "repetition_context_size", "presence_context_size",
          "frequency_context_size", "logit_bias", "logprobs", "top_logprobs",
          "num_draft_tokens"} | NO_EFFECT
CHAT = COMMON | {"messages", "max_completion_tokens", "tools", "tool_choice",
                 "parallel_tool_calls", "response_format", "chat_template_kwargs",
                 "role_mapping", "reasoning_effort", "modalities"}
COMPLETIONS = COMMON | {"prompt", "echo", "best_of"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_PROMPTS = 64  # prompts of one batched completions request


class OpenAIAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self):
        s = self
        return [Route("/v1/chat/completions", s.chat, methods=["POST"]),
                Route("/chat/completions", s.chat, methods=["POST"]),
                Route("/v1/completions", s.completions, methods=["POST"]),
                Route("/v1/models", s.models, methods=["GET"]),
                Route("/v1/models/{model:path}", s.model, methods=["GET"])]

    # -- models --------------------------------------------------------------------------
    def _card(self, name: str) -> dict:
        return {"id": name, "object": "model", "created": self.server.created,
                "owned_by": "edgemoe"}

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            self._card(n) for n in sorted(self.server.names, key=lambda n: (
                n != self.server.model_id, n))]})

    async def model(self, request: Request):
        name = request.path_params["model"]
        if name not in self.server.names:
            return error_response(f"the model {name!r} does not exist", 404, "model")
        return JSONResponse(self._card(name))

    # -- requests ------------------------------------------------------------------------
    def _options(self, body: dict, chat: bool) -> dict:
        s = self.server
        d = s.sampling_defaults
        n = field(body, "n", int, 1)
        if n != 1:
            raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
        if not chat and field(body, "best_of", int, 1) != 1:
            raise BadRequest("'best_of' must be 1 (one choice per request)", "best_of")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        penalties = dict(
            presence_penalty=field(body, "presence_penalty", NUMBER, 0.0, lo=-2, hi=2),
            frequency_penalty=field(body, "frequency_penalty", NUMBER, 0.0, lo=-2, hi=2),
            repetition_penalty=field(body, "repetition_penalty", NUMBER, 0.0, lo=0),
            **{k: field(body, k, int, 20, lo=1) for k in (
                "repetition_context_size", "presence_context_size", "frequency_context_size")})
        if penalties["repetition_penalty"] in (0.0, 1.0):
            penalties["repetition_penalty"] = None
        stream = field(body, "stream", bool, False)
        stream_options = field(body, "stream_options", dict, {})
        if stream_options and not stream:
            raise BadRequest("'stream_options' is only allowed with 'stream': true",
                             "stream_options")
        refuse_unknown(stream_options, {"include_usage", "include_obfuscation"},
                       "stream_options",
                       "stream_options.")
        return dict(
            stream=stream, include_usage=bool(stream_options.get("include_usage")),
            model=s.model_name(body),
            sampling=dict(temperature=field(body, "temperature", NUMBER, d.get(
                              "temperature", 0.0), lo=0, hi=2),
                          top_p=field(body, "top_p", NUMBER, d.get("top_p", 1.0), lo=0, hi=1),
                          top_k=s.top_k_field(body, default=d.get("top_k", 0)),
                          min_p=field(body, "min_p", NUMBER, d.get("min_p", 0.0), lo=0,
                                      hi=1),
                          seed=field(body, "seed", int, lo=0, hi=2**63 - 1),
                          stop=stop_strings(body.get("stop")), penalties=penalties,
                          logit_bias=s.logit_bias(body.get("logit_bias"))),
            max_tokens=field(body, name, int, None, lo=0 if not chat else 1),
            max_tokens_name=name,
            num_draft_tokens=s.draft_tokens_field(body))

    def _messages(self, body: dict) -> List[dict]:
        messages = body.get("messages")
        if messages is None:
            raise BadRequest("'messages' is required", "messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of "
                             "{\"role\": ..., \"content\": ...} objects", "messages")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"{where} must be an object with a string 'role'",
                                 "messages")
            if m["role"] not in ROLES:
                raise BadRequest(f"{where}.role must be one of {', '.join(ROLES)}, got "
                                 f"{m['role']!r}", "messages")
            refuse_unknown(m, {"role", "content", "name", "tool_calls", "tool_call_id",
                               "refusal", "reasoning", "reasoning_content"},
                           "messages", where + ".")
            message: Dict[str, Any] = {"role": "system" if m["role"] == "developer"
                                       else m["role"],
                                       "content": text_of(m.get("content"), where)}
            if m.get("tool_calls"):
                if m["role"] != "assistant":
                    raise BadRequest(f"{where}: only assistant messages have 'tool_calls'",
                                     "messages")
                message["tool_calls"] = tool_call_message(m["tool_calls"], where)
            elif m.get("content") is None and m["role"] != "assistant":
                raise BadRequest(f"{where}: 'content' is required", "messages")
            for key in ("name", "tool_call_id"):
                if m.get(key) is not None:
                    message[key] = str(m[key])
            if m["role"] == "tool" and "tool_call_id" not in message:
                raise BadRequest(f"{where}: a tool message needs its 'tool_call_id'",
                                 "messages")
            clean.append(message)
        return clean

    def _grammar(self, body: dict, tools: Optional[list]):
        """The grammar a response_format or a forced tool choice asks for, or None; and
        how the reply's tool calls are read: "forced" (the grammar's one call), "parse"
        (the model's tool parser) or None (not at all)."""
        s = self.server
        choice = body.get("tool_choice")
        fmt = field(body, "response_format", dict)
        grammar, parse = None, "parse" if tools else None
        if fmt is not None:
            kind = fmt.get("type")
            try:
                if kind == "json_object":
                    grammar = Grammar.json(s.grammar_tokens())
                elif kind == "json_schema":
                    spec = fmt.get("json_schema")
                    if not (isinstance(spec, dict) and isinstance(spec.get("schema", {}),
                                                                  dict)):
                        raise BadRequest("'response_format.json_schema' must be "
                                         "{\"name\": ..., \"schema\": {...}}",
                                         "response_format")
                    grammar = Grammar.json(s.grammar_tokens(), spec.get("schema"))
                elif kind != "text":
                    raise BadRequest(f"'response_format.type' must be text, json_object or "
                                     f"json_schema, got {kind!r}", "response_format")
            except GrammarError as e:
                raise BadRequest(f"'response_format' schema: {e}", "response_format") \
                    from None
            if grammar is not None:
                grammar.param = "response_format"
        if choice in (None, "auto"):
            if tools and s.tokenizer.tool_parser is None:
                raise BadRequest(no_tool_format(s.tokenizer), "tools")
            return grammar, parse
        if choice == "none":
            return grammar, None
        name = None
        if isinstance(choice, dict):
            fn = choice.get("function")
            if not (choice.get("type") == "function" and isinstance(fn, dict)
                    and isinstance(fn.get("name"), str)):
                raise BadRequest("'tool_choice' must be none, auto, required or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                                 "tool_choice")
            name = fn["name"]
        elif choice != "required":
            raise BadRequest(f"'tool_choice' must be none, auto, required or a function, "
                             f"got {choice!r}", "tool_choice")
        if not tools:
            raise BadRequest("'tool_choice' asks for a tool call, but no 'tools' are given",
                             "tool_choice")
        if name is not None and name not in [t["function"]["name"] for t in tools]:
            raise BadRequest(f"'tool_choice' names {name!r}, which is not in 'tools'",
                             "tool_choice")
        # a forced call is the reply: response_format, which shapes text, has nothing to
        # shape (OpenAI takes both, and agents send both)
        return forced_call(s, tools, name), "forced"

    def parse_chat(self, body: dict):
        s = self.server
        refuse_unknown(body, CHAT, "chat completions")
        opts = self._options(body, chat=True)
        logprobs = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if top and not logprobs:
            raise BadRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        parallel = field(body, "parallel_tool_calls", bool, True)
        check_reasoning_effort(s, body)
        modalities = field(body, "modalities", list, ["text"])
        if modalities != ["text"]:
            raise BadRequest(f"'modalities' must be [\"text\"] (this model writes text), "
                             f"got {modalities}", "modalities")
        messages = self._messages(body)
        tools = check_tools(body.get("tools"))
        grammar, reading = self._grammar(body, tools)
        template_args = {**s.template_args,
                         **field(body, "chat_template_kwargs", dict, {})}
        prompt = render(s.tokenizer, messages, tools if reading else None,
                        template_args, field(body, "role_mapping", dict))
        job = s.job(prompt, max_tokens=opts["max_tokens"],
                    max_tokens_name=opts["max_tokens_name"], prompt_param="messages",
                    grammar=grammar, id_prefix="chatcmpl-", want_logprobs=logprobs,
                    top_logprobs=top, num_draft_tokens=opts["num_draft_tokens"],
                    **opts["sampling"])
        return job, opts, Reply(s.tokenizer, prompt, tools, parse_tools=reading == "parse",
                                forced=reading == "forced",
                                max_calls=None if parallel else 1)

    def parse_completion(self, body: dict):
        s = self.server
        refuse_unknown(body, COMPLETIONS, "completions")
        opts = self._options(body, chat=False)
        if body.get("prompt") is None:
            raise BadRequest("'prompt' is required", "prompt")
        # mlx_lm.server's logprobs is a boolean and top_logprobs a count; OpenAI's
        # logprobs is the count: both are taken
        logprobs = field(body, "logprobs", (bool, int), False)
        top = field(body, "top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if not isinstance(logprobs, bool):
            if not 0 <= logprobs <= MAX_TOP_LOGPROBS:
                raise BadRequest(f"'logprobs' must be between 0 and {MAX_TOP_LOGPROBS}, "
                                 f"got {logprobs}", "logprobs")
            top, logprobs = max(top, logprobs), True
        opts["echo"] = field(body, "echo", bool, False)
        # max_tokens 0 scores the prompt alone (with echo and logprobs: what an evaluation
        # harness's loglikelihood asks); the engine decodes one token, which is not shown
        opts["score_only"] = opts["max_tokens"] == 0
        jobs = []
        for prompt in self._prompts(body["prompt"]):
            job = s.job(prompt, max_tokens=1 if opts["score_only"] else opts["max_tokens"],
                        max_tokens_name=opts["max_tokens_name"], prompt_param="prompt",
                        id_prefix="cmpl-", want_logprobs=logprobs, top_logprobs=top,
                        prompt_logprobs=opts["echo"] and logprobs,
                        use_prompt_cache=not (opts["echo"] and logprobs),
                        num_draft_tokens=opts["num_draft_tokens"], **opts["sampling"])
            job.detokenizer = untrimmed_detokenizer(s.tokenizer)  # text == its tokens
            jobs.append(job)
        if len(jobs) > 1:
            raise Batched(jobs, opts)
        return jobs[0], opts, None

    def _prompts(self, prompt) -> List[List[int]]:
        """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a
        list of lists of token ids; each one prompt (of one choice)."""
        s = self.server
        batch = isinstance(prompt, list) and prompt and all(
            isinstance(p, (str, list)) for p in prompt)
        if not batch:
            return [s.text_tokens(prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} "
                             f"are taken in one request", "prompt")
        return [s.text_tokens(p, f"prompt[{i}]") for i, p in enumerate(prompt)]

    async def chat(self, request: Request):
        return await self.server.respond(request, self.parse_chat, self._view, _error)

    async def completions(self, request: Request):
        try:
            return await self.server.respond(request, self.parse_completion, self._view,
                                             _error)
        except Batched as batch:  # several prompts: a choice each, decoded together
            return await self._batch(request, batch.jobs, batch.opts)

    def _view(self, job, opts, reply):
        return View(self.server, job, opts, reply)

    async def _batch(self, request: Request, jobs: list, opts: dict):
        s = self.server
        queues = []
        try:
            for job in jobs:
                queues.append(await s.submit(job, request))
        except BadRequest as e:
            for job in jobs[:len(queues)]:
                s.engine.cancel(job)
            return _error(e.message, e.status, e.param)
        views = [View(s, job, opts, None, index=i, alone=False)
                 for i, job in enumerate(jobs)]
        if opts["stream"]:
            return event_stream(self._merged(jobs, queues, views, opts))
        try:
            results = await asyncio.gather(*(s.collect(request, job, events)
                                             for job, events in zip(jobs, queues)))
        except ClientGone:
            for job in jobs:
                s.engine.cancel(job)
            return _error("client disconnected", 499, None)
        failed = [last for _, last in results if last["type"] == "error"]
        if failed:
            return _error(public(failed[0]["message"]), 500, None)
        out = [view.whole(tokens, last) for view, (tokens, last) in zip(views, results)]
        whole = out[0]
        whole["choices"] = [o["choices"][0] for o in out]
        whole["usage"] = _summed([o["usage"] for o in out])
        return JSONResponse(whole)

    async def _merged(self, jobs: list, queues: list, views: list, opts: dict):
        """The streams of several prompts as one, each chunk with its choice's index."""
        s = self.server
        merged: asyncio.Queue = asyncio.Queue()
        usages = []

        async def pump(job, events, view):
            try:
                async for chunk in s.stream(job, events, view.chunks):
                    await merged.put(chunk)
            finally:
                usages.append(view.usage)
                await merged.put(None)

        tasks = [asyncio.create_task(pump(*a)) for a in zip(jobs, queues, views)]
        try:
            left = len(tasks)
            while left:
                chunk = await merged.get()
                if chunk is None:
                    left -= 1
                else:
                    yield chunk
            if opts["include_usage"] and all(usages):
                tail = views[0].base(chunk=True)
                tail.update(choices=[], usage=_summed(usages))
                yield sse(tail)
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()


class Batched(Exception):
    """A completions request of several prompts (parse_completion's answer, which
    Server.respond, made for one job, passes up)."""

    def __init__(self, jobs: list, opts: dict):
        super().__init__(f"{len(jobs)} prompts")
        self.jobs, self.opts = jobs, opts


def _error(message: str, status: int, param: Optional[str]):
    return error_response(message, status, param,
                          "invalid_request_error" if status < 500 else "server_error")


def _summed(usages: List[dict]) -> dict:
    keys = ("prompt_tokens", "completion_tokens", "total_tokens")
    return {**{k: sum(u[k] for u in usages) for k in keys},
            "prompt_tokens_details": {"cached_tokens": sum(
                u["prompt_tokens_details"]["cached_tokens"] for u in usages)}}


def check_reasoning_effort(server: Server, body: dict, name: str = "reasoning_effort"):
    """Accepted for a model that does not reason (it changes nothing); a reasoning
    model's thinking is switched by chat_template_kwargs (enable_thinking) instead."""
    effort = body.get(name)
    if effort is not None and server.tokenizer.has_thinking:
        raise BadRequest(f"'{name}' is not supported: this model's thinking is switched by "
                         f"chat_template_kwargs {{\"enable_thinking\": false}}", name)


class View:
    """One request's events as OpenAI's responses: whole, or as server-sent chunks.
    `index`: its choice's (one of several prompts); `alone`: the stream is its own (it
    ends with the usage chunk and [DONE]), not one of several merged."""

    def __init__(self, server: Server, job, opts: dict, reply: Optional[Reply],
                 index: int = 0, alone: bool = True):
        self.server, self.job, self.opts, self.reply = server, job, opts, reply
        self.chat = reply is not None
        self.index, self.alone = index, alone
        self.started = False
        self.offset = 0  # the text's length so far (streamed completions' text_offset)
        self.usage: Optional[dict] = None  # once done

    def base(self, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat \
            else "text_completion"
        return {"id": self.job.id, "object": kind, "created": self.server.created,
                "model": self.opts["model"], "system_fingerprint": f"edgemoe-{__version__}"}

    def _usage(self, last: dict) -> dict:
        p = last["prompt_tokens"]
        c = 0 if self.opts.get("score_only") else last["completion_tokens"]
        self.usage = {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                      "prompt_tokens_details": {"cached_tokens": last["cached_tokens"]}}
        return self.usage

    def _entries(self, events: List[dict]) -> List[dict]:
        """Chat logprobs entries (also mlx_lm.server's completions form, with ids)."""
        tok = self.server.tokenizer
        ids = [e["token"] for e in events]
        tops = [e["top"] or [] for e in events]
        pieces = token_pieces(tok, ids + [t for top in tops for t, _ in top])
        chosen, rest = pieces[:len(ids)], iter(pieces[len(ids):])
        out = []
        for e, (text, data), top in zip(events, chosen, tops):
            entry = {"id": e["token"], "token": text, "logprob": e["logprob"],
                     "bytes": data, "top_logprobs": []}
            for t, lp in top:
                t_text, t_data = next(rest)
                entry["top_logprobs"].append({"id": t, "token": t_text, "logprob": lp,
                                              "bytes": t_data})
            out.append(entry)
        return out

    def _legacy(self, entries: List[dict], offset: int, prompt: Optional[List] = None):
        """Completions logprobs in OpenAI's form (tokens, token_logprobs, top_logprobs,
        text_offset), beside mlx_lm.server's `content`."""
        entries = (prompt or []) + entries
        offsets, at = [], offset
        for e in entries:
            offsets.append(at)
            at += len(e["token"])
        return {"tokens": [e["token"] for e in entries],
                "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]}
                                 if e["top_logprobs"] else None for e in entries]
                if self.job.top_logprobs else None,
                "text_offset": offsets, "content": entries}

    def _prompt_entries(self, last: dict) -> List[dict]:
        """The prompt's tokens as logprobs entries: each one's logprob given the tokens
        before it (the first has none) and, asked for, the most likely tokens there."""
        scores = last.get("prompt_logprobs") or []
        tops = last.get("prompt_top") if self.job.top_logprobs else None
        tops = tops or [None] * len(scores)
        events = [{"token": t, "logprob": lp, "top": top}
                  for t, lp, top in zip(self.job.prompt, scores, tops)]
        return self._entries(events)

    def _echo(self) -> str:
        """The prompt's text, exactly its tokens' bytes (no space trimmed)."""
        if not self.opts.get("echo"):
            return ""
        pieces = token_pieces(self.server.tokenizer, self.job.prompt)
        return b"".join(bytes(data) for _, data in pieces).decode("utf-8", "replace")

    def _shown(self, events: List[dict]) -> List[dict]:
        return [] if self.opts.get("score_only") else events

    def whole(self, events: List[dict], last: dict) -> dict:
        out = self.base(chunk=False)
        events = self._shown(events)
        text = "".join(e["text"] for e in events)
        choice: Dict[str, Any] = {"index": self.index,
                                  "finish_reason": last["finish_reason"], "logprobs": None}
        if self.chat:
            content, reasoning, calls = self.reply.feed(text, final=True)
            # "" for an empty reply, as OpenAI's; null beside tool calls, as OpenAI's
            message: Dict[str, Any] = {"role": "assistant",
                                       "content": content if content or not calls else None}
            if reasoning:
                message["reasoning"] = reasoning
            if calls:
                message["tool_calls"] = calls
            choice["message"] = message
            choice["finish_reason"] = self.reply.finish_reason(last["finish_reason"])
            if self.job.want_logprobs:
                choice["logprobs"] = {"content": self._entries(events)}
        else:
            echo = self._echo()
            choice["text"] = echo + text
            if self.opts.get("score_only"):
                choice["finish_reason"] = "length"
            if self.job.want_logprobs:
                prompt = self._prompt_entries(last) if self.opts["echo"] else None
                choice["logprobs"] = self._legacy(self._entries(events),
                                                  0 if prompt else len(echo), prompt)
        out["choices"] = [choice]
        out["usage"] = self._usage(last)
        return out

    def chunks(self, event: dict):
        """The SSE chunks of one engine event."""
        if event["type"] == "error":
            yield sse({"error": {"message": public(event["message"]),
                                 "type": "server_error", "param": None, "code": None}})
            return
        if not self.started and not self.chat and self.opts.get("echo"):
            self.started = True
            echo, logprobs = self._echo(), None
            if self.job.want_logprobs:  # the prompt was scored before its first token came
                logprobs = self._legacy([], 0, self._prompt_entries(
                    {"prompt_logprobs": self.job.prompt_scores,
                     "prompt_top": self.job.prompt_top}))
            self.offset = len(echo)
            yield sse(self._chunk({"text": echo}, None, logprobs))
        self.started = True
        if event["type"] == "token":
            if not self.opts.get("score_only"):
                yield from self._token_chunks(event)
            return
        finish = "length" if self.opts.get("score_only") else event["finish_reason"]
        if self.chat:
            content, reasoning, calls = self.reply.feed("", final=True)
            if content or reasoning or calls:
                yield sse(self._chunk(self._delta(content, reasoning, calls)))
            finish = self.reply.finish_reason(finish)
        yield sse(self._chunk({} if self.chat else {"text": ""}, finish))
        usage = self._usage(event)
        if not self.alone:
            return
        if self.opts["include_usage"]:
            tail = self.base(chunk=True)
            tail.update(choices=[], usage=usage)
            yield sse(tail)
        yield "data: [DONE]\n\n"

    def _token_chunks(self, event: dict):
        logprobs = None
        if self.job.want_logprobs:
            entries = self._entries([event])
            logprobs = {"content": entries} if self.chat else \
                self._legacy(entries, self.offset)
            self.offset += len(entries[0]["token"])
        if self.chat:
            content, reasoning, calls = self.reply.feed(event["text"])
            if content or reasoning or calls or logprobs:
                yield sse(self._chunk(self._delta(content, reasoning, calls), None,
                                      logprobs))
        elif event["text"] or logprobs:
            yield sse(self._chunk({"text": event["text"]}, None, logprobs))

    def _delta(self, content: str, reasoning: str, calls: List[dict]) -> dict:
        delta: Dict[str, Any] = {"role": "assistant"}
        if content:
            delta["content"] = content
        if reasoning:
            delta["reasoning"] = reasoning
        if calls:
            first = len(self.reply.calls) - len(calls)
            delta["tool_calls"] = [{"index": first + i, **c} for i, c in enumerate(calls)]
        return delta

    def _chunk(self, part: dict, finish: Optional[str] = None, logprobs=None) -> dict:
        out = self.base(chunk=True)
        choice: Dict[str, Any] = {"index": self.index, "finish_reason": finish,
                                  "logprobs": logprobs}
        if self.chat:
            choice["delta"] = part
        else:
            choice.update(part)
        out["choices"] = [choice]
        return out
