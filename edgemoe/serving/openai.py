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
from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .canonical import Conversation, Generation, Sampling
from .chat import check_tools, text_of, tool_call_message, untrimmed_detokenizer
from .errors import BadRequest, error_response
from .fields import (MAX_DRAFT_TOKENS, MAX_TOP_LOGPROBS, NO_EFFECT, NUMBER,
                     check_reasoning_effort, field, refuse_unknown, response_format_grammar,
                     stop_strings, tool_choice)
from .http import ClientGone, Server, event_stream, public, sse
from .openai_view import OpenAIDelivery, View, error, summed

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
    def _request(self, body: dict, chat: bool) -> Tuple[OpenAIDelivery, Generation]:
        """The fields chat completions and completions share: how the result goes back,
        and the generation (its prompt still empty)."""
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
                       "stream_options", "stream_options.")
        delivery = OpenAIDelivery(model=s.model_name(body), stream=stream,
                                  include_usage=bool(stream_options.get("include_usage")))
        sampling = Sampling(
            temperature=field(body, "temperature", NUMBER, d.get("temperature", 0.0),
                              lo=0, hi=2),
            top_p=field(body, "top_p", NUMBER, d.get("top_p", 1.0), lo=0, hi=1),
            top_k=s.top_k_field(body, default=d.get("top_k", 0)),
            min_p=field(body, "min_p", NUMBER, d.get("min_p", 0.0), lo=0, hi=1),
            seed=field(body, "seed", int, lo=0, hi=2**63 - 1),
            stop=stop_strings(body.get("stop")), penalties=penalties,
            logit_bias=logit_bias(s, body.get("logit_bias")))
        return delivery, Generation(
            prompt=[], max_tokens=field(body, name, int, None, lo=0 if not chat else 1),
            max_tokens_name=name, sampling=sampling,
            num_draft_tokens=draft_tokens_field(s, body))

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

    @staticmethod
    def _function_name(choice: dict) -> str:
        """The name of a forced function: {"type": "function", "function": {"name": ...}}."""
        fn = choice.get("function")
        if not (choice.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str)):
            raise BadRequest("'tool_choice' must be none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}",
                             "tool_choice")
        return fn["name"]

    def parse_chat(self, body: dict):
        s = self.server
        refuse_unknown(body, CHAT, "chat completions")
        delivery, generation = self._request(body, chat=True)
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
        fmt = response_format_grammar(s, field(body, "response_format", dict))
        conversation = Conversation(
            messages, tools, tool_choice(body.get("tool_choice"), tools, self._function_name), fmt,
            {**s.template_args, **field(body, "chat_template_kwargs", dict, {})},
            field(body, "role_mapping", dict), max_calls=None if parallel else 1)
        prompt, grammar, reply = conversation.prompt(s)
        job = s.job(replace(generation, prompt=prompt, prompt_param="messages",
                            grammar=grammar, id_prefix="chatcmpl-",
                            want_logprobs=logprobs, top_logprobs=top))
        return job, delivery, reply

    def parse_completion(self, body: dict):
        s = self.server
        refuse_unknown(body, COMPLETIONS, "completions")
        delivery, generation = self._request(body, chat=False)
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
        delivery.echo = echo = field(body, "echo", bool, False)
        # max_tokens 0 scores the prompt alone (with echo and logprobs: what an evaluation
        # harness's loglikelihood asks); the engine decodes one token, which is not shown
        delivery.score_only = generation.max_tokens == 0
        generation = replace(generation, id_prefix="cmpl-", want_logprobs=logprobs,
                             top_logprobs=top, prompt_logprobs=echo and logprobs,
                             use_prompt_cache=not (echo and logprobs),
                             max_tokens=1 if delivery.score_only else generation.max_tokens)
        jobs = []
        for prompt in self._prompts(body["prompt"]):
            job = s.job(replace(generation, prompt=prompt))
            job.detokenizer = untrimmed_detokenizer(s.tokenizer)  # text == its tokens
            jobs.append(job)
        if len(jobs) > 1:
            raise Batched(jobs, delivery)
        return jobs[0], delivery, None

    def _prompts(self, prompt) -> List[List[int]]:
        """OpenAI's prompt forms: a string, a list of strings, a list of token ids, or a
        list of lists of token ids; each one prompt (of one choice)."""
        s = self.server
        batch = isinstance(prompt, list) and prompt and all(
            isinstance(p, (str, list)) for p in prompt)
        if not batch:
            return [text_tokens(s, prompt)]
        if len(prompt) > MAX_PROMPTS:
            raise BadRequest(f"'prompt' holds {len(prompt)} prompts; at most {MAX_PROMPTS} "
                             f"are taken in one request", "prompt")
        return [text_tokens(s, p, f"prompt[{i}]") for i, p in enumerate(prompt)]

    async def chat(self, request: Request):
        return await self.server.respond(request, self.parse_chat, self._view, error)

    async def completions(self, request: Request):
        try:
            return await self.server.respond(request, self.parse_completion, self._view,
                                             error)
        except Batched as batch:  # several prompts: a choice each, decoded together
            return await self._batch(request, batch.jobs, batch.delivery)

    def _view(self, job, delivery: OpenAIDelivery, reply):
        return View(self.server, job, delivery, reply)

    async def _batch(self, request: Request, jobs: list, delivery: OpenAIDelivery):
        s = self.server
        queues = []
        try:
            for job in jobs:
                queues.append(await s.submit(job, request))
        except BadRequest as e:
            for job in jobs[:len(queues)]:
                s.engine.cancel(job)
            return error(e.message, e.status, e.param)
        views = [View(s, job, delivery, None, index=i, alone=False)
                 for i, job in enumerate(jobs)]
        if delivery.stream:
            return event_stream(self._merged(jobs, queues, views, delivery))
        try:
            results = await asyncio.gather(*(s.collect(request, job, events)
                                             for job, events in zip(jobs, queues)))
        except ClientGone:
            for job in jobs:
                s.engine.cancel(job)
            return error("client disconnected", 499, None)
        failed = [r.last for r in results if r.last["type"] == "error"]
        if failed:
            return error(public(failed[0]["message"]), 500, None)
        out = [view.whole(result) for view, result in zip(views, results)]
        whole = out[0]
        whole["choices"] = [o["choices"][0] for o in out]
        whole["usage"] = summed([o["usage"] for o in out])
        return JSONResponse(whole)

    async def _merged(self, jobs: list, queues: list, views: list,
                      delivery: OpenAIDelivery):
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
            if delivery.include_usage and all(usages):
                tail = views[0].base(chunk=True)
                tail.update(choices=[], usage=summed(usages))
                yield sse(tail)
            yield "data: [DONE]\n\n"
        finally:
            for task in tasks:
                task.cancel()


class Batched(Exception):
    """A completions request of several prompts (parse_completion's answer, which
    Server.respond, made for one job, passes up)."""

    def __init__(self, jobs: list, delivery: OpenAIDelivery):
        super().__init__(f"{len(jobs)} prompts")
        self.jobs, self.delivery = jobs, delivery


# -- OpenAI's (and mlx_lm.server's) own fields ------------------------------------------

def text_tokens(server, prompt, param: str = "prompt") -> List[int]:
    """A prompt as text (tokenized) or token ids (checked against the vocabulary)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return server.tokenizer.encode(prompt)
    vocab = server.vocab_size
    if (isinstance(prompt, list) and prompt
            and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise BadRequest(f"'{param}' token id {bad[0]} is out of range "
                             f"[0, {vocab})", param)
        return list(prompt)
    raise BadRequest(f"'{param}' must be a string or a non-empty array of token ids "
                     f"(or, for several prompts, an array of those)", param)


def draft_tokens_field(server, body: dict) -> Optional[int]:
    """mlx_lm.server's per-request draft length: drafts per window, fixed for this
    request (else the server's DraftLength adapts it, at most --num-draft-tokens)."""
    count = field(body, "num_draft_tokens", int, None, lo=0, hi=MAX_DRAFT_TOKENS)
    if count and not server.engine.drafting:
        raise BadRequest("'num_draft_tokens' needs a draft: this server was started "
                         "without --draft-model or --prompt-lookup", "num_draft_tokens")
    return count


def logit_bias(server, value, name: str = "logit_bias") -> Optional[Dict[int, float]]:
    """OpenAI's {"token id": bias in [-100, 100]}."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise BadRequest(f"'{name}' must be an object of token id: bias", name)
    bias = {}
    for key, b in value.items():
        try:
            token = int(key)
        except ValueError:
            raise BadRequest(f"'{name}' keys must be token ids, got {key!r}",
                             name) from None
        if not (0 <= token < (server.vocab_size or 2**31)):
            raise BadRequest(f"'{name}' token id {token} is out of range "
                             f"[0, {server.vocab_size})", name)
        bias[token] = field({key: b}, key, NUMBER, lo=-100, hi=100, where=name + ".")
    return bias
