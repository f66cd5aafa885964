"""Ollama's API: `/api/chat`, `/api/generate` (newline-delimited JSON when streamed, as
Ollama streams by default), `/api/tags`, `/api/show`, `/api/ps`, `/api/version`, so that
Ollama's client and the apps built on it connect unchanged.

Sampling defaults are Ollama's (temperature 0.8, top_k 40, top_p 0.9) where a request
gives none and the server sets none (--temp, --top-p, --top-k, --min-p): apps written for
Ollama rely on them. Ollama's resource options (threads,
GPU layers, batch size, mmap) have no meaning here, where the expert budget decides
memory; they are accepted and do nothing. Sampling options this server does not implement
are accepted at their neutral value (mirostat 0, tfs_z 1, typical_p 1), where they change
nothing, and refused with a 400 naming them otherwise; so is any other unknown option.
A body is read as JSON whatever its content type (`curl -d` sends a form's).
"""

import json
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route

from .. import __version__
from .canonical import Conversation, Delivery, Generation, Result, Sampling
from .chat import Reply, arguments_object, check_tools, render, text_of, token_pieces
from .constrain import Grammar, GrammarError
from .errors import BadRequest
from .fields import MAX_TOP_LOGPROBS, NUMBER, field, refuse_unknown, stop_strings
from .http import Server, public

DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.9}
SAMPLING = {"temperature", "top_p", "top_k", "min_p", "seed", "num_predict", "stop",
            "repeat_penalty", "repeat_last_n", "presence_penalty", "frequency_penalty",
            "num_ctx"}
RESOURCES = {"num_thread", "num_gpu", "main_gpu", "num_batch", "use_mmap", "use_mlock",
             "numa", "low_vram", "num_keep", "f16_kv", "logits_all", "vocab_only",
             "embedding_only",
             # Ollama itself ignores it now; mirostat's own knobs do nothing without it
             "penalize_newline", "mirostat_tau", "mirostat_eta"}
NEUTRAL = {"mirostat": 0, "tfs_z": 1.0, "typical_p": 1.0}  # sampling not implemented here
OUR_NAMES = {"repetition_penalty": "repeat_penalty"}  # Ollama's names of the engine's
COMMON = {"model", "stream", "format", "options", "keep_alive", "think", "logprobs",
          "top_logprobs"}
CHAT = COMMON | {"messages", "tools"}
GENERATE = COMMON | {"prompt", "system", "raw", "suffix", "images"}


@dataclass
class OllamaDelivery(Delivery):
    chat: bool = True  # /api/chat's message, or /api/generate's response


def error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def loaded(model: str, chat: bool) -> dict:
    """The answer to a request without a prompt (Ollama loads the model and says so)."""
    out = {"model": model, "created_at": now(), "done": True, "done_reason": "load"}
    if chat:
        out["message"] = {"role": "assistant", "content": ""}
    else:
        out["response"] = ""
    return out


def now() -> str:
    return datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")


class OllamaAPI:
    def __init__(self, server: Server):
        self.server = server

    def routes(self):
        return [Route("/", self.running, methods=["GET", "HEAD"]),
                Route("/api/chat", self.chat, methods=["POST"]),
                Route("/api/generate", self.generate, methods=["POST"]),
                Route("/api/tags", self.tags, methods=["GET"]),
                Route("/api/show", self.show, methods=["POST"]),
                Route("/api/ps", self.ps, methods=["GET"]),
                Route("/api/version", self.version, methods=["GET"])]

    # -- models --------------------------------------------------------------------------
    def _name(self) -> str:
        return self.server.model_id.rstrip("/").rsplit("/", 1)[-1] + ":latest"

    def _details(self) -> dict:
        t = self.server.model_type
        return {"format": "edgemoe", "family": t, "families": [t], "parameter_size": "",
                "quantization_level": ""}

    def _card(self) -> dict:
        return {"name": self._name(), "model": self._name(), "size": self.server.model_bytes,
                "modified_at": datetime.fromtimestamp(self.server.created, timezone.utc)
                .isoformat(), "details": self._details()}

    async def running(self, request: Request):
        """Ollama's liveness ping (apps and Claude Code check it before their first
        request)."""
        return PlainTextResponse("Ollama is running")

    async def tags(self, request: Request):
        return JSONResponse({"models": [self._card()]})

    async def ps(self, request: Request):
        return JSONResponse({"models": [{**self._card(), "size_vram": 0,
                                         "context_length": self.server.context_length}]})

    async def version(self, request: Request):
        return JSONResponse({"version": __version__})

    async def show(self, request: Request):
        s = self.server
        try:
            body = await s.body(request)
            refuse_unknown(body, {"model", "name", "verbose"}, "/api/show")
            s.model_name(body, "model" if "model" in body else "name", required=True)
        except BadRequest as e:
            return error(e.message, e.status)
        tok = s.tokenizer
        capabilities = ["completion"] + (["tools"] if tok.tool_parser else []) + \
            (["thinking"] if tok.has_thinking else [])
        template = tok.chat_template if isinstance(tok.chat_template, str) else ""
        info = {"general.architecture": s.model_type,
                f"{s.model_type}.context_length": s.context_length}
        if s.experts_per_token is not None:  # as llama.cpp's GGUF keys name them
            info[f"{s.model_type}.expert_used_count"] = s.experts_per_token.used
        return JSONResponse({
            "template": template, "modelfile": "", "parameters": "",
            "details": self._details(), "capabilities": capabilities,
            "model_info": info,
            "modified_at": self._card()["modified_at"]})

    # -- requests ------------------------------------------------------------------------
    def _options(self, body: dict):
        """(num_ctx, num_predict as max_tokens, the sampling) from `options`."""
        s = self.server
        options = field(body, "options", dict, {})
        refuse_unknown(options, SAMPLING | RESOURCES | set(NEUTRAL), "Ollama's options",
                       "options.")
        for name, neutral in NEUTRAL.items():
            value = field(options, name, NUMBER, neutral, where="options.")
            if value != neutral:
                raise BadRequest(f"'options.{name}' {value} is not supported (only its "
                                 f"neutral value {neutral}, which changes nothing)",
                                 "options." + name)
        o = {**DEFAULTS, **s.sampling_defaults,
             **{k: v for k, v in options.items() if v is not None}}
        # as Ollama does, a num_ctx past the model's context is lowered to it (Continue
        # and others send a large one whatever the model)
        num_ctx = min(field(o, "num_ctx", int, s.context_length, lo=1, where="options."),
                      s.context_length)
        predict = field(o, "num_predict", int, -1, lo=-2, where="options.")
        repeat = field(o, "repeat_penalty", NUMBER, 1.0, lo=0, where="options.")
        last_n = field(o, "repeat_last_n", int, 64, lo=-1, where="options.")
        last_n = num_ctx if last_n == -1 else max(last_n, 1)
        return num_ctx, predict if predict > 0 else None, Sampling(
            temperature=field(o, "temperature", NUMBER, lo=0, where="options."),
            top_p=field(o, "top_p", NUMBER, lo=0, hi=1, where="options."),
            top_k=s.top_k_field(o, where="options."),
            min_p=field(o, "min_p", NUMBER, 0.0, lo=0, hi=1, where="options."),
            seed=field(o, "seed", int, lo=0, hi=2**63 - 1, where="options."),
            stop=stop_strings(o.get("stop"), "options.stop"),
            penalties=dict(
                repetition_penalty=None if repeat in (0.0, 1.0) else repeat,
                repetition_context_size=last_n,
                presence_penalty=field(o, "presence_penalty", NUMBER, 0.0, where="options."),
                presence_context_size=last_n,
                frequency_penalty=field(o, "frequency_penalty", NUMBER, 0.0,
                                        where="options."),
                frequency_context_size=last_n))

    def _format(self, body: dict):
        fmt = body.get("format")
        if fmt in (None, ""):
            return None
        try:
            if fmt == "json" or isinstance(fmt, dict):
                grammar = Grammar.json(self.server.grammar_tokens(),
                                       fmt if isinstance(fmt, dict) else None)
                grammar.param = "format"
                return grammar
        except GrammarError as e:
            raise BadRequest(f"'format' schema: {e}", "format") from None
        raise BadRequest(f"'format' must be \"json\" or a JSON schema, got "
                         f"{json.dumps(fmt)[:60]}", "format")

    def _template_args(self, body: dict) -> dict:
        args = dict(self.server.template_args)
        think = body.get("think")
        if think is not None:
            if not isinstance(think, bool):
                raise BadRequest("'think' must be true or false (levels are not supported)",
                                 "think")
            if think and not self.server.tokenizer.has_thinking:
                raise BadRequest(f"the model {self._name()!r} does not think", "think")
            args["enable_thinking"] = think
        return args

    def _messages(self, body: dict) -> List[dict]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            raise BadRequest("'messages' must be an array", "messages")
        out = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            if not (isinstance(m, dict) and m.get("role") in ("system", "user", "assistant",
                                                              "tool")):
                raise BadRequest(f"{where}: 'role' must be system, user, assistant or tool",
                                 "messages")
            refuse_unknown(m, {"role", "content", "images", "tool_calls", "tool_name",
                               "thinking"}, "messages", where + ".")
            if m.get("images"):
                raise BadRequest(f"{where}: images are not supported by this model",
                                 "messages")
            message: Dict[str, Any] = {"role": m["role"],
                                       "content": text_of(m.get("content"), where)}
            if m.get("tool_calls"):
                message["tool_calls"] = [
                    {"type": "function", "function": {
                        "name": c["function"]["name"],
                        "arguments": c["function"].get("arguments") or {}}}
                    for c in m["tool_calls"]]
            if m.get("tool_name"):
                message["name"] = str(m["tool_name"])
            out.append(message)
        return out

    def _job(self, body: dict, prompt: List[int], grammar, prompt_param: str):
        num_ctx, max_tokens, sampling = self._options(body)
        logprobs = field(body, "logprobs", bool, False)
        top = field(body, "top_logprobs", int, 0, lo=0, hi=MAX_TOP_LOGPROBS)
        if len(prompt) >= num_ctx:
            raise BadRequest(f"the prompt is {len(prompt)} tokens; 'options.num_ctx' is "
                             f"{num_ctx}", "options.num_ctx")
        return self.server.job(Generation(
            prompt, max_tokens, sampling, max_tokens_name="options.num_predict",
            prompt_param=prompt_param, sampling_prefix="options.",
            sampling_names=OUR_NAMES, grammar=grammar, id_prefix="ollama-",
            want_logprobs=logprobs, top_logprobs=top))

    def parse_chat(self, body: dict):
        s = self.server
        refuse_unknown(body, CHAT, "/api/chat")
        model = s.model_name(body, required=True)
        tools = check_tools(body.get("tools"))
        if tools and s.tokenizer.tool_parser is None:  # (Ollama has no forced calls)
            raise BadRequest(f"the model {self._name()!r} does not support tools: its chat "
                             f"template has no tool-call format mlx-lm can read", "tools")
        messages = self._messages(body)
        if not messages:  # Ollama's way to load a model, which is loaded
            return None, loaded(model, chat=True), None
        prompt, _, reply = Conversation(
            messages, tools, template_args=self._template_args(body)).prompt(s)
        job = self._job(body, prompt, self._format(body), "messages")
        return job, OllamaDelivery(model, field(body, "stream", bool, True)), reply

    def parse_generate(self, body: dict):
        s = self.server
        refuse_unknown(body, GENERATE, "/api/generate")
        model = s.model_name(body, required=True)
        if body.get("images"):
            raise BadRequest("images are not supported by this model", "images")
        if body.get("suffix"):
            raise BadRequest("'suffix' (fill in the middle) is not supported", "suffix")
        text = field(body, "prompt", str, "")
        if not text:  # Ollama's way to load a model, which is loaded
            return None, loaded(model, chat=False), None
        system = field(body, "system", str)
        if field(body, "raw", bool, False) or not s.tokenizer.has_chat_template:
            prompt = s.tokenizer.encode((system + "\n\n" if system else "") + text)
        else:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                [{"role": "user", "content": text}]
            prompt = render(s.tokenizer, messages, None, self._template_args(body))
        job = self._job(body, prompt, self._format(body), "prompt")
        delivery = OllamaDelivery(model, field(body, "stream", bool, True), chat=False)
        return job, delivery, Reply(s.tokenizer, prompt, None)

    async def chat(self, request: Request):
        return await self._run(request, self.parse_chat)

    async def generate(self, request: Request):
        return await self._run(request, self.parse_generate)

    async def _run(self, request: Request, parse):
        return await self.server.respond(
            request, parse, lambda job, delivery, reply: Lines(self.server, job, delivery, reply),
            lambda message, status, param: error(message, status),
            media_type="application/x-ndjson")


class Lines:
    """One request's events as Ollama's responses: one object, or a line per piece."""

    def __init__(self, server: Server, job, delivery: OllamaDelivery,
                 reply: Optional[Reply]):
        self.server, self.job, self.delivery, self.reply = server, job, delivery, reply
        self.first: Optional[float] = None  # when the first token was made

    def _piece(self, content: str, reasoning: str, calls: List[dict],
               events: List[dict]) -> dict:
        out: Dict[str, Any] = {"model": self.delivery.model, "created_at": now()}
        if self.delivery.chat:
            message: Dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning:
                message["thinking"] = reasoning
            if calls:
                message["tool_calls"] = [{"function": {
                    "name": c["function"]["name"],
                    "arguments": arguments_object(c)}} for c in calls]
            out["message"] = message
        else:
            out["response"] = content
            if reasoning:
                out["thinking"] = reasoning
        if self.job.want_logprobs and events:
            out["logprobs"] = self._logprobs(events)
        out["done"] = False
        return out

    def _logprobs(self, events: List[dict]) -> List[dict]:
        tok = self.server.tokenizer
        out = []
        for e in events:
            top = e["top"] or []
            pieces = token_pieces(tok, [e["token"]] + [t for t, _ in top])
            entry = {"token": pieces[0][0], "logprob": e["logprob"]}
            if self.job.top_logprobs:
                entry["top_logprobs"] = [{"token": p[0], "logprob": lp}
                                         for p, (_, lp) in zip(pieces[1:], top)]
            out.append(entry)
        return out

    def _done(self, out: dict, last: dict) -> dict:
        """The last piece, with Ollama's counts and durations (ns): the prompt's from the
        request's arrival to its first token, the reply's from there to its end, as the
        engine made them (clients divide eval_count by eval_duration)."""
        end = last.get("at") or time.perf_counter()
        first = self.first or end
        ns = 1_000_000_000
        out.update(done=True, done_reason=self.reply.finish_reason(last["finish_reason"])
                   .replace("tool_calls", "stop"),
                   total_duration=int((end - self.job.received) * ns), load_duration=0,
                   prompt_eval_count=last["prompt_tokens"] - last["cached_tokens"],
                   prompt_eval_duration=int((first - self.job.received) * ns),
                   eval_count=last["completion_tokens"],
                   eval_duration=int((end - first) * ns))
        return out

    def whole(self, result: Result) -> dict:
        events = result.events
        self.first = events[0].get("at") if events else None
        piece = self._piece(*self.reply.feed(result.text, final=True), events)
        return self._done(piece, result.last)

    def chunks(self, event: dict):
        if event["type"] == "error":
            yield json.dumps({"error": public(event["message"])}) + "\n"
            return
        if event["type"] == "token":
            self.first = self.first or event.get("at") or time.perf_counter()
            content, reasoning, calls = self.reply.feed(event["text"])
            if content or reasoning or calls or self.job.want_logprobs:
                yield json.dumps(self._piece(content, reasoning, calls, [event]),
                                 ensure_ascii=False) + "\n"
            return
        piece = self._piece(*self.reply.feed("", final=True), [])
        yield json.dumps(self._done(piece, event), ensure_ascii=False) + "\n"
