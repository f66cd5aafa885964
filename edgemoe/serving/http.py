"""What every API shares over one engine, knowing none of them: reading bodies, running a
job, cancelling it when its client leaves, /health and /metrics (edgemoe.serving.app puts
the APIs and these together into the app).

The HTTP layer (Starlette on uvicorn, one asyncio loop) validates and tokenizes each
request, then hands it to the engine thread (edgemoe.serving.engine), which owns the model
and decodes every request in flight together, one step at a time. Each API module (a
dialect) reads a body into the canonical request (edgemoe.serving.canonical), which
becomes an engine `Job`, and renders the job's result in its own shape.
"""

import asyncio
import json
import logging
import os
import re
import time
import uuid
from typing import Any, AsyncIterator, Dict, List, Optional, Tuple
from urllib.parse import urlsplit

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse

from .cache_scope import cache_scope
from .canonical import Generation, Result
from .constrain import Grammar, Tokens, vetted
from .errors import BadRequest, error_response
from .engine import Engine
from .fields import field
from .job import Job
from .limits import BoundedTokenizer

log = logging.getLogger("edgemoe.server")

DEFAULT_MAX_TOKENS = 512
MAX_BODY_BYTES = 4 * 2**20  # a request body larger than this gets a 413
LOCAL_HOSTS = ("127.0.0.1", "localhost", "::1")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
SEND_TIMEOUT_S = 30.0  # a stream whose client takes nothing for this long is cancelled
# the folders of a path: absolute, ~ or ./ relative, or relative before a file.ext
_DIRECTORIES = re.compile(r"(?<![\w.~/-])(?:(?:~|\.{1,2})?/(?:[\w.~-]+/)*(?=[\w.-])"
                          r"|(?:[\w.~-]+/)+(?=[\w-]+(?:\.[\w-]+)*\.[A-Za-z]\w*\b))")


class Server:
    """What every API needs: the model's facts, the engine, and running a job."""

    def __init__(self, engine: Engine, model_id: str, context_length: int,
                 vocab_size: Optional[int] = None,
                 default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 allowed_hosts: Optional[List[str]] = None,
                 send_timeout_s: float = SEND_TIMEOUT_S,
                 aliases: Tuple[str, ...] = (), template_args: Optional[dict] = None,
                 sampling_defaults: Optional[dict] = None, model_type: str = "",
                 model_bytes: int = 0):
        """`allowed_hosts`: the Host header names requests may carry (None: any), so
        that a web page cannot reach a local server by DNS rebinding. `send_timeout_s`:
        how long a streamed chunk may wait for its client to read before the request is
        cancelled and its batch row freed. `aliases`: other model names requests may
        give (any other name is a 404). `sampling_defaults`: temperature, top_p, top_k,
        min_p of requests that give none, over each API's own."""
        self.engine = engine
        self.send_timeout_s = send_timeout_s
        self.sending: Dict[Job, Tuple[float, asyncio.Queue]] = {}  # chunks not yet taken
        self.streams: Dict[Job, asyncio.Queue] = {}  # the streamed requests in flight
        self.web_origins: List[str] = []  # --cors-origin: pages that may call (make_app)
        self.loop: Optional[asyncio.AbstractEventLoop] = None  # the app's (lifespan)
        self.allowed_hosts = allowed_hosts
        self.vocab_size = vocab_size
        # a local folder is shown by its name alone: clients never see the server's folders
        # (its path is still taken as a name); a hub id is shown as it is
        shown = model_id.rstrip("/").rsplit("/", 1)[-1] \
            if os.path.exists(os.path.expanduser(model_id)) else model_id
        self.model_id = shown
        self.names = {shown, shown.rsplit("/", 1)[-1], *aliases}
        self.hidden_names = {model_id}  # taken in requests, never listed
        self.context_length = context_length
        self.default_max_tokens = default_max_tokens
        self.template_args = template_args or {}
        self.sampling_defaults = sampling_defaults or {}
        self.model_type, self.model_bytes = model_type, model_bytes
        self.created = int(time.time())
        self._grammar_tokens = None
        self._bounded = None  # the tokenizer as the APIs use it
        # whose cached prefixes a request reuses (--prompt-cache-scope, serving.cache_scope)
        self.prompt_cache_scope = "key"
        # the loaded routing (edgemoe.server.build): /metrics' "routing", whether it is exact
        self.routing: dict = {}
        self.experts_per_token = None  # routing.modes.ExpertsPerToken

    @property
    def tokenizer(self):
        """The model's tokenizer, its texts' sizes checked before tokenizing (limits)."""
        inner = self.engine.tokenizer
        if self._bounded is None or self._bounded._inner is not inner:
            self._bounded = BoundedTokenizer(inner, self.context_length)
        return self._bounded

    def grammar_tokens(self):
        """The tokenizer as the grammar engine sees it (made on first use)."""
        if self._grammar_tokens is None:
            self._grammar_tokens = Tokens(self.tokenizer, self.vocab_size
                                          or len(self.tokenizer.get_vocab()))
        return self._grammar_tokens

    # -- what every API's request comes to ------------------------------------------
    def model_name(self, body: dict, name: str = "model", required: bool = False) -> str:
        """The request's model name: this server's (or an alias), else a 404."""
        model = field(body, name, str)
        if model is None:
            if required:
                raise BadRequest(f"'{name}' is required", name)
            return self.model_id
        if model not in self.names | self.hidden_names and \
                model.removesuffix(":latest") not in self.names:
            raise BadRequest(f"the model {model!r} does not exist: this server serves "
                             f"{self.model_id!r} (add names with --model-alias)", name, 404)
        return model

    def job(self, generation: Generation) -> Job:
        """The engine's job for a request's `generation`, checked against the context."""
        return generation.job(uuid.uuid4().hex[:24], self.context_length,
                              self.default_max_tokens)

    def top_k_field(self, body: dict, name: str = "top_k", where: str = "",
                    default: int = 0) -> int:
        vocab = self.vocab_size
        return field(body, name, int, default, lo=0, hi=vocab - 1 if vocab else None,
                     where=where)

    # -- running a job ---------------------------------------------------------------
    async def respond(self, request: Request, parse, view, error,
                      media_type: str = "text/event-stream"):
        """One request of any API, start to end: its body `parse`d off the event loop
        (tokenizing a long prompt, or compiling a grammar, must not hold it up) into
        (job, delivery, reply), or (None, a response body, None) for a request answered
        without generating; the job run; its events given by `view(job, delivery,
        reply)` (`.chunks(event)` streamed, `.whole(result)` at once); failures as the
        API's `error(message, status, param)`."""
        try:
            body = await self.body(request)
            self.ready()
            job, delivery, reply = await asyncio.to_thread(parse, body)
            if job is None:
                return JSONResponse(delivery)
            events = await self.submit(job, request)
        except BadRequest as e:
            return error(e.message, e.status, e.param)
        shown = view(job, delivery, reply)
        if delivery.stream:
            return event_stream(self.stream(job, events, shown.chunks), media_type)
        try:
            result = await self.collect(request, job, events)
        except ClientGone:
            return error("client disconnected", 499, None)
        last = result.last
        if last["type"] == "error":  # a 400 where the request's own grammar failed
            return error(public(last["message"]), last.get("status", 500), last.get("param"))
        return JSONResponse(shown.whole(result))

    async def submit(self, job: Job, request: Optional[Request] = None) -> asyncio.Queue:
        """Queue `job` (of `request`: its prompt-cache scope) on the engine; its events
        arrive on the returned queue."""
        if request is not None:
            job.cache_scope = cache_scope(request, self.prompt_cache_scope)
        if isinstance(job.grammar, Grammar):
            await vetted(job.grammar)  # its costly first mask, off the batch
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def emit(event):
            event.setdefault("at", time.perf_counter())  # when it was made (durations)
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the loop has closed: the server is stopping
                job.cancelled = True

        job.emit = emit
        if not self.engine.submit(job):
            raise BadRequest(f"the server is busy ({self.engine.waiting()} requests "
                             f"waiting); try again later", status=503)
        return events

    async def collect(self, request: Request, job: Job, events: asyncio.Queue) -> Result:
        """All of a job's token events and its last event (done or error); a client that
        goes away cancels the job (ClientGone)."""
        tokens = []
        loop = asyncio.get_running_loop()
        checked = loop.time()
        try:
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
                        raise ClientGone()
                if event is None:
                    continue
                if event["type"] == "token":
                    tokens.append(event)
                    continue
                return Result(tokens, event)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise

    async def stream(self, job: Job, events: asyncio.Queue, chunks) -> AsyncIterator[str]:
        """`chunks(event)` of each of the job's events, sent as they come; a client that
        stops reading for send_timeout_s, or goes away, cancels the job."""
        finished = False
        loop = asyncio.get_running_loop()
        self.streams[job] = events
        try:
            while True:
                event = await events.get()
                for chunk in chunks(event):
                    self.sending[job] = (loop.time(), events)
                    yield chunk
                    self.sending.pop(job, None)  # the client took it
                if event["type"] != "token":
                    finished = True
                    return
        finally:  # the client went away (cancelled task or closed generator)
            self.sending.pop(job, None)
            self.streams.pop(job, None)
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

    # -- requests ----------------------------------------------------------------------
    def close_streams(self, message: str = "the server is shutting down"):
        """End every stream in flight with an error event (each in its API's form) and
        cancel its request: a client sees why its stream ended, not a cut connection.
        Run on the event loop (server.py's shutdown schedules it there)."""
        for job, events in list(self.streams.items()):
            self.engine.cancel(job)
            events.put_nowait({"type": "error", "message": message})

    def refused(self, request: Request) -> Optional[JSONResponse]:
        """A response for a request from where none may come, or None: another Host
        (DNS rebinding), or a browser page of another origin (its Origin header), which
        may send a body of any content type without asking first."""
        host = request.headers.get("host", "")
        name = host.rsplit(":", 1)[0] if not host.startswith("[") else host[1:host.find("]")]
        if self.allowed_hosts is not None and name not in self.allowed_hosts:
            return error_response(f"Host {host!r} is not a name of this server (allowed: "
                                  f"{', '.join(self.allowed_hosts)}; see --allowed-host)", 400)
        origin = request.headers.get("origin")
        if origin is not None and not self.origin_allowed(origin):
            return error_response(f"a web page of origin {origin!r} may not call this "
                                  f"server (allowed: this machine's pages and "
                                  f"--cors-origin)", 403)
        return None

    def origin_allowed(self, origin: str) -> bool:
        """A page of this machine (a local host name, or one --allowed-host names), or
        an origin given by --cors-origin."""
        if origin in self.web_origins or "*" in self.web_origins:
            return True
        host = urlsplit(origin).hostname if "://" in origin else None
        return host is not None and (host in LOCAL_HOSTS or host in (self.allowed_hosts
                                                                    or ()))

    async def body(self, request: Request) -> Any:
        """The JSON body (BadRequest otherwise), at most MAX_BODY_BYTES, whatever its
        declared content type (`curl -d` sends a form's), as Ollama and mlx_lm.server
        take it; web pages are kept out by their Origin (`refused`)."""
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise BadRequest(f"the request body is {declared} bytes; at most "
                             f"{MAX_BODY_BYTES} are taken", status=413)
        raw = bytearray()
        try:
            async for chunk in request.stream():
                raw += chunk
                if len(raw) > MAX_BODY_BYTES:
                    raise BadRequest(f"the request body is over {MAX_BODY_BYTES} bytes",
                                     status=413)
        except ClientDisconnect:  # gone, or closed past --request-timeout (serving.guard)
            raise BadRequest("the client sent no whole body in time", status=408) from None
        try:
            body = json.loads(bytes(raw))
        except (ValueError, RecursionError) as e:  # a JSONDecodeError, invalid UTF-8, or
            #                                        an integer over Python's 4300 digits
            raise BadRequest(f"invalid JSON in the request body: "
                             f"{str(e)[:200] or type(e).__name__}") from None
        try:  # "\ud800" is valid JSON, but no text: the tokenizer cannot take it (only
            #   an escape makes one: the body is valid UTF-8; json.dumps of a 4 MB body
            #   holds the event loop for 0.1 s, the search a few ms)
            if _SURROGATE_ESCAPE.search(raw):
                json.dumps(body, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError as e:
            raise BadRequest(f"invalid Unicode in the request body: a lone surrogate "
                             f"({e.object[e.start:e.end]!r})") from None
        if not isinstance(body, dict):
            raise BadRequest("the request body must be a JSON object")
        return body

    def ready(self):
        if not self.engine.alive:
            raise BadRequest("the model is not loaded", status=503)

    async def health(self, request: Request):
        ok = self.engine.alive and self.engine.store_healthy()
        body = {"status": "ok" if ok else "unavailable"}
        health = self.engine.health
        if ok and not health.serving():  # every recent request failed: say why
            ok, body = False, {"status": "unavailable", "reason": public(
                f"the last {health.failing} requests failed: {health.last_failure}"[:500])}
        return JSONResponse(body, status_code=200 if ok else 503)

    async def metrics(self, request: Request):
        return JSONResponse({**self.engine.snapshot(), "routing": self.routing})


class ClientGone(Exception):
    """The client of a non-streamed request went away; its job is cancelled."""


def public(message: str) -> str:
    """An error message as clients see it: file names without the server's folders."""
    return _DIRECTORIES.sub("", message)


def sse(obj: dict, event: Optional[str] = None) -> str:
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def event_stream(generator, media_type: str = "text/event-stream") -> StreamingResponse:
    return StreamingResponse(generator, media_type=media_type,
                             headers={"Cache-Control": "no-cache"})
