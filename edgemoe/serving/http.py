"""The HTTP side of the server: OpenAI's and mlx_lm.server's API over the engine.

Endpoints, with the request and response shapes of `mlx_lm.server` and OpenAI's API:
`POST /v1/completions`, `POST /v1/chat/completions` (server-sent events when
`"stream": true`), `GET /v1/models`, `GET /health`, and `GET /metrics` (JSON: tokens per
second, latency percentiles, expert bytes read and reused).

The HTTP layer (Starlette on uvicorn, one asyncio loop) validates and tokenizes each
request, then hands it to the engine thread (`edgemoe.engine`), which owns the model and
decodes every request in flight together, one step at a time.
"""

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from typing import Any, Dict, List, Optional, Tuple

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from .. import __version__
from .engine import Engine, Job

log = logging.getLogger("edgemoe.server")

DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 4 * 2**20  # a request body larger than this gets a 413
MAX_STOP_STRINGS, MAX_STOP_CHARS = 16, 256
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
SEND_TIMEOUT_S = 30.0  # a stream whose client takes nothing for this long is cancelled
# the folders of a path: absolute, ~ or ./ relative, or relative before a file.ext
_DIRECTORIES = re.compile(r"(?<![\w.~/-])(?:(?:~|\.{1,2})?/(?:[\w.~-]+/)*(?=[\w.-])"
                          r"|(?:[\w.~-]+/)+(?=[\w-]+(?:\.[\w-]+)*\.[A-Za-z]\w*\b))")


class BadRequest(Exception):
    def __init__(self, message: str, param: Optional[str] = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def error_response(message: str, status: int = 400, param: Optional[str] = None,
                   kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param,
                                   "code": None}}, status_code=status)


# ---- request parsing ---------------------------------------------------------------

_NUMBER = (int, float)


def _field(body: dict, name: str, types, default=None, lo=None, hi=None, nullable=True):
    value = body.get(name, default)
    if value is None and nullable:
        return default
    # bool is an int in Python; a JSON true is never a valid number here
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in
                                         (types if isinstance(types, tuple) else (types,))):
        names = types if isinstance(types, tuple) else (types,)
        expected = " or ".join({"int": "integer", "float": "number", "str": "string",
                                "bool": "boolean", "list": "array", "dict": "object"}
                               .get(t.__name__, t.__name__) for t in names)
        raise BadRequest(f"'{name}' must be {'an' if expected[0] in 'aeiou' else 'a'} "
                         f"{expected}, got {type(value).__name__} {json.dumps(value)[:60]}",
                         name)
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(f"'{name}' must be a finite number, got {value}", name)
    if lo is not None and value < lo:
        raise BadRequest(f"'{name}' must be at least {lo}, got {value}", name)
    if hi is not None and value > hi:
        raise BadRequest(f"'{name}' must be at most {hi}, got {value}", name)
    return value


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"
                    and isinstance(part.get("text"), str)):
                raise BadRequest(f"{where}: only text content parts "
                                 f"({{\"type\": \"text\", \"text\": ...}}) are supported",
                                 "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRequest(f"{where}: 'content' must be a string or a list of text parts",
                     "messages")


class Server:
    """Turns HTTP requests into engine jobs and job events into OpenAI responses."""

    def __init__(self, engine: Engine, model_id: str, context_length: int,
                 vocab_size: Optional[int] = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 allowed_hosts: Optional[List[str]] = None,
                 send_timeout_s: float = SEND_TIMEOUT_S):
        """`allowed_hosts`: the Host header names requests may carry (None: any), so
        that a web page cannot reach a local server by DNS rebinding. `send_timeout_s`:
        how long a streamed chunk may wait for its client to read before the request is
        cancelled and its batch row freed."""
        self.engine = engine
        self.send_timeout_s = send_timeout_s
        self.sending: Dict[Job, Tuple[float, asyncio.Queue]] = {}  # chunks not yet taken
        self.allowed_hosts = allowed_hosts
        self.vocab_size = vocab_size
        self.model_id = model_id
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.created = int(time.time())

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- prompt ----------------------------------------------------------------
    def chat_prompt(self, body: dict) -> List[int]:
        messages = body.get("messages")
        if messages is None:
            raise BadRequest("'messages' is required", "messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("'messages' must be a non-empty array of "
                             "{\"role\": ..., \"content\": ...} objects", "messages")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise BadRequest(f"messages[{i}] must be an object with a string 'role'",
                                 "messages")
            clean.append({"role": m["role"],
                          "content": _content_text(m.get("content", ""), f"messages[{i}]")})
        tok = self.tokenizer
        if tok.has_chat_template:
            text = tok.apply_chat_template(clean, tokenize=False, add_generation_prompt=True)
            return tok.encode(text, add_special_tokens=False)
        from mlx_lm.server import convert_chat
        return tok.encode(convert_chat(clean, body.get("role_mapping")))

    def text_prompt(self, body: dict) -> List[int]:
        prompt = body.get("prompt")
        if prompt is None:
            raise BadRequest("'prompt' is required", "prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        vocab = self.vocab_size
        if (isinstance(prompt, list) and prompt
                and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
            bad = [t for t in prompt if t < 0 or (vocab is not None and t >= vocab)]
            if bad:
                raise BadRequest(f"'prompt' token id {bad[0]} is out of range "
                                 f"[0, {vocab})", "prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be a string or a non-empty array of token ids "
                         "(one prompt per request)", "prompt")

    # -- arguments -------------------------------------------------------------
    def parse(self, body: Any, chat: bool) -> Tuple[Job, dict]:
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        opts = {
            "stream": _field(body, "stream", bool, False),
            "model": _field(body, "model", str, self.model_id),
        }
        stream_options = _field(body, "stream_options", dict, {})
        opts["include_usage"] = bool(stream_options.get("include_usage", False))
        n = _field(body, "n", int, 1)
        if n != 1:
            raise BadRequest(f"'n' must be 1 (one choice per request), got {n}", "n")
        temperature = _field(body, "temperature", _NUMBER, 0.0, lo=0)
        top_p = _field(body, "top_p", _NUMBER, 1.0, lo=0, hi=1)
        vocab = self.vocab_size
        top_k = _field(body, "top_k", int, 0, lo=0, hi=vocab - 1 if vocab else None)
        min_p = _field(body, "min_p", _NUMBER, 0.0, lo=0, hi=1)
        seed = _field(body, "seed", int, lo=0, hi=2**63 - 1)  # a random key takes 63 bits
        logprobs = _field(body, "logprobs", (bool, int) if not chat else bool, False)
        stop = body.get("stop") or []
        if isinstance(stop, str):
            stop = [stop]
        if not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("'stop' must be a string or an array of non-empty strings",
                             "stop")
        if len(stop) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in stop):
            raise BadRequest(f"'stop' takes at most {MAX_STOP_STRINGS} strings of at most "
                             f"{MAX_STOP_CHARS} characters, got {len(stop)} (longest "
                             f"{max(map(len, stop))})", "stop")
        name = "max_completion_tokens" if body.get("max_completion_tokens") is not None \
            else "max_tokens"
        max_tokens = _field(body, name, int, None, lo=1)

        prompt = self.chat_prompt(body) if chat else self.text_prompt(body)
        if not prompt:
            raise BadRequest("the prompt is empty after tokenization",
                             "messages" if chat else "prompt")
        room = self.context_length - len(prompt)
        if room < 1:
            raise BadRequest(f"the prompt is {len(prompt)} tokens; the model's context is "
                             f"{self.context_length} tokens, and at least one must be left "
                             f"for the completion", "messages" if chat else "prompt")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise BadRequest(f"the model's context is {self.context_length} tokens; the "
                             f"prompt is {len(prompt)} and '{name}' asks for {max_tokens} "
                             f"more ({len(prompt) + max_tokens} in all)", name)

        sampling = None  # greedy
        if temperature > 0:
            sampling = dict(temp=temperature, top_p=top_p, min_p=min_p, top_k=top_k,
                            seed=seed)
        job = Job(id=("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24],
                  prompt=prompt, max_tokens=max_tokens, emit=lambda e: None,
                  sampling=sampling, stop=stop, want_logprobs=bool(logprobs))
        return job, opts

    # -- responses -------------------------------------------------------------
    def _base(self, job: Job, opts: dict, chat: bool, chunk: bool) -> dict:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat \
            else "text_completion"
        return {"id": job.id, "object": kind, "created": self.created,
                "model": opts["model"], "system_fingerprint": f"edgemoe-{__version__}"}

    @staticmethod
    def _logprobs(items):
        return {"content": [{"id": t, "logprob": lp} for t, lp in items]}

    def _chunk(self, job, opts, chat, text, finish, logprobs=None) -> dict:
        out = self._base(job, opts, chat, chunk=True)
        choice: Dict[str, Any] = {"index": 0, "finish_reason": finish}
        if chat:
            choice["delta"] = {"role": "assistant", **({"content": text} if text else {})}
        else:
            choice["text"] = text
        if logprobs:
            choice["logprobs"] = self._logprobs(logprobs)
        out["choices"] = [choice]
        return out

    def _usage(self, event: dict) -> dict:
        p, c = event["prompt_tokens"], event["completion_tokens"]
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    # -- endpoints -------------------------------------------------------------
    async def completions(self, request: Request):
        return await self._complete(request, chat=False)

    async def chat_completions(self, request: Request):
        return await self._complete(request, chat=True)

    def refused(self, request: Request) -> Optional[JSONResponse]:
        """A response for a request from where none may come, or None."""
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.find("]")]
        if self.allowed_hosts is not None and name not in self.allowed_hosts:
            return error_response(f"Host {host!r} is not a name of this server (allowed: "
                                  f"{', '.join(self.allowed_hosts)}; see --allowed-host)", 400)
        return None

    async def _body(self, request: Request):
        """The JSON body, or an error response: JSON only (a web page cannot send that
        without the browser asking first), and at most MAX_BODY_BYTES."""
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            return None, error_response(f"the request body must be JSON sent as "
                                        f"Content-Type: application/json, got {kind!r}", 415)
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            return None, error_response(f"the request body is {declared} bytes; at most "
                                        f"{MAX_BODY_BYTES} are taken", 413)
        raw = bytearray()
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > MAX_BODY_BYTES:
                return None, error_response(f"the request body is over {MAX_BODY_BYTES} "
                                            f"bytes", 413)
        try:
            body = json.loads(bytes(raw))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
            return None, error_response(f"invalid JSON in the request body: "
                                        f"{str(e)[:200] or type(e).__name__}")
        try:  # "\ud800" is valid JSON, but no text: the tokenizer cannot take it
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            return None, error_response(f"invalid Unicode in the request body: a lone "
                                        f"surrogate ({e.object[e.start:e.end]!r})")
        return body, None

    async def _complete(self, request: Request, chat: bool):
        body, error = await self._body(request)
        if error is not None:
            return error
        if not self.engine.alive:
            return error_response("the model is not loaded", 503, kind="server_error")
        try:  # tokenizing a long prompt must not hold up the event loop
            job, opts = await asyncio.to_thread(self.parse, body, chat)
        except BadRequest as e:
            return error_response(e.message, e.status, e.param)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event):
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop has closed: the server is stopping
                job.cancelled = True

        job.emit = emit
        if not self.engine.submit(job):
            return error_response(f"the server is busy ({self.engine.waiting()} requests "
                                  f"waiting); try again later", 503, kind="server_error")
        if opts["stream"]:
            return StreamingResponse(self._stream(job, opts, chat, events),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._collect(request, job, opts, chat, events)

    async def _collect(self, request, job, opts, chat, events):
        text, logprobs = [], []
        try:
            loop = asyncio.get_running_loop()
            checked = loop.time()
            while True:
                try:
                    event = await asyncio.wait_for(events.get(), timeout=0.25)
                except asyncio.TimeoutError:
                    event = None
                if loop.time() - checked >= 0.25:  # a client that left frees its row
                    checked = loop.time()
                    if await request.is_disconnected():
                        log.info("request %s: client went away", job.id)
                        self.engine.cancel(job)
                        return error_response("client disconnected", 499)
                if event is None:
                    continue
                if event["type"] == "error":
                    return error_response(public(event["message"]), 500, kind="server_error")
                if event["type"] == "token":
                    text.append(event["text"])
                    if job.want_logprobs:
                        logprobs.append((event["token"], event["logprob"]))
                    continue
                out = self._base(job, opts, chat, chunk=False)
                choice: Dict[str, Any] = {"index": 0, "finish_reason": event["finish_reason"]}
                if chat:
                    choice["message"] = {"role": "assistant", "content": "".join(text)}
                else:
                    choice["text"] = "".join(text)
                if job.want_logprobs:
                    choice["logprobs"] = self._logprobs(logprobs)
                out["choices"] = [choice]
                out["usage"] = self._usage(event)
                return JSONResponse(out)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise

    async def _stream(self, job, opts, chat, events):
        finished = False
        loop = asyncio.get_running_loop()
        try:
            while True:
                event = await events.get()
                if event["type"] == "error":
                    yield _sse({"error": {"message": public(event["message"]),
                                          "type": "server_error", "param": None,
                                          "code": None}})
                    finished = True
                    return
                if event["type"] == "token":
                    lp = [(event["token"], event["logprob"])] if job.want_logprobs else None
                    if event["text"] or lp:
                        self.sending[job] = (loop.time(), events)
                        yield _sse(self._chunk(job, opts, chat, event["text"], None, lp))
                        self.sending.pop(job, None)  # the client took it
                    continue
                yield _sse(self._chunk(job, opts, chat, "", event["finish_reason"]))
                if opts["include_usage"]:
                    usage = self._base(job, opts, chat, chunk=True)
                    usage.update(choices=[], usage=self._usage(event))
                    yield _sse(usage)
                yield "data: [DONE]\n\n"
                finished = True
                return
        finally:  # the client went away (cancelled task or closed generator)
            self.sending.pop(job, None)
            if not finished:
                log.info("request %s: client disconnected mid-stream", job.id)
                self.engine.cancel(job)

    async def watch_sends(self):
        """Cancel the streams of clients that stopped reading: once the socket's buffers
        are full a chunk waits in `send`; after `send_timeout_s` its request is cancelled,
        so its batch row goes to a request whose client is there."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(1.0, self.send_timeout_s / 4))
            for job, (since, events) in list(self.sending.items()):
                if loop.time() - since > self.send_timeout_s:
                    log.warning("request %s: the client read nothing for %.0f s; cancelled",
                                job.id, self.send_timeout_s)
                    self.sending.pop(job, None)
                    self.engine.cancel(job)
                    events.put_nowait({"type": "error", "message": (
                        f"cancelled: the client read nothing for {self.send_timeout_s:g} s")})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [
            {"id": self.model_id, "object": "model", "created": self.created,
             "owned_by": "edgemoe"}]})

    async def health(self, request: Request):
        ok = self.engine.alive and self.engine.store_healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"},
                            status_code=200 if ok else 503)

    async def metrics(self, request: Request):
        return JSONResponse(self.engine.snapshot())


def public(message: str) -> str:
    """An error message as clients see it: file names without the server's folders."""
    return _DIRECTORIES.sub("", message)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def _http_error(request: Request, exc: HTTPException):
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    return error_response(message, exc.status_code)


async def _internal_error(request: Request, exc: Exception):
    """A bug: logged with its traceback; the client gets JSON without server paths."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(f"internal server error: {type(exc).__name__}: "
                          f"{public(str(exc))[:500]}", 500, kind="server_error")


def make_app(server: Server) -> Starlette:
    @contextlib.asynccontextmanager
    async def lifespan(app):
        watch = asyncio.create_task(server.watch_sends())
        yield
        watch.cancel()
        # uvicorn re-raises SIGTERM once the app has shut down: stop the engine here,
        # so its thread frees the model and its MLX streams before the process ends.
        await asyncio.to_thread(server.engine.stop)

    class CheckHost:
        """Refuses requests whose Host header is not this server's, before any route."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                refused = server.refused(Request(scope))
                if refused is not None:
                    return await refused(scope, receive, send)
            await self.app(scope, receive, send)

    return Starlette(
        lifespan=lifespan,
        middleware=[Middleware(CheckHost)],
        routes=[
            Route("/v1/completions", server.completions, methods=["POST"]),
            Route("/v1/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/chat/completions", server.chat_completions, methods=["POST"]),
            Route("/v1/models", server.models, methods=["GET"]),
            Route("/health", server.health, methods=["GET"]),
            Route("/metrics", server.metrics, methods=["GET"]),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
