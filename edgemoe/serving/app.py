"""The server's app: three APIs over one engine (edgemoe.serving.http holds what they share).

- OpenAI's (and mlx_lm.server's): `POST /v1/chat/completions`, `POST /v1/completions`,
  `GET /v1/models`, `GET /v1/models/{id}` (edgemoe.serving.openai), and its Responses
  API, `POST /v1/responses` (edgemoe.serving.responses);
- Anthropic's Messages: `POST /v1/messages`, `POST /v1/messages/count_tokens`
  (edgemoe.serving.anthropic);
- Ollama's: `POST /api/chat`, `POST /api/generate`, `GET /api/tags`, `POST /api/show`,
  `GET /api/version` (edgemoe.serving.ollama);
- and `GET /health`, `GET /metrics` (JSON: tokens per second, latency percentiles, expert
  bytes read and reused, prompt-cache hits).
"""

import asyncio
import contextlib
import logging
from typing import List, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from .access import LogRefusals
from .anthropic import AnthropicAPI
from .errors import error_response
from .http import Server, public
from .ollama import OllamaAPI
from .openai import OpenAIAPI
from .responses import ResponsesAPI

log = logging.getLogger("edgemoe.server")


async def _http_error(request: Request, exc: HTTPException):
    message = {404: f"no route {request.url.path}",
               405: f"{request.method} is not allowed on {request.url.path}"}.get(
        exc.status_code, str(exc.detail))
    if request.url.path.startswith("/api/"):  # Ollama's routes answer in Ollama's shape
        return JSONResponse({"error": message}, status_code=exc.status_code)
    return error_response(message, exc.status_code)


async def _internal_error(request: Request, exc: Exception):
    """A bug: logged with its traceback; the client gets JSON without server paths."""
    log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(f"internal server error: {type(exc).__name__}: "
                          f"{public(str(exc))[:500]}", 500, kind="server_error")


def make_app(server: Server, cors_origins: Optional[List[str]] = None) -> Starlette:
    """The app; `cors_origins`: web origins whose pages may read its responses."""
    server.web_origins = list(cors_origins or [])

    @contextlib.asynccontextmanager
    async def lifespan(app):
        server.loop = asyncio.get_running_loop()
        watch = asyncio.create_task(server.watch_sends())
        yield
        watch.cancel()
        # uvicorn re-raises SIGTERM once the app has shut down: stop the engine here,
        # so its thread frees the model and its MLX streams before the process ends.
        await asyncio.to_thread(server.engine.stop)

    class CheckHost:
        """Refuses requests whose Host header is not this server's, or that a web page of
        another origin sends, before any route."""

        def __init__(self, app):
            self.app = app

        async def __call__(self, scope, receive, send):
            if scope["type"] == "http":
                refused = server.refused(Request(scope))
                if refused is not None:
                    return await refused(scope, receive, send)
            await self.app(scope, receive, send)

    routes = [Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.metrics, methods=["GET"])]
    for api in (OpenAIAPI(server), ResponsesAPI(server), AnthropicAPI(server),
                OllamaAPI(server)):
        routes += api.routes()
    middleware = [Middleware(LogRefusals), Middleware(CheckHost)]
    if cors_origins:
        from starlette.middleware.cors import CORSMiddleware
        middleware.append(Middleware(CORSMiddleware, allow_origins=cors_origins,
                                     allow_methods=["GET", "POST"], allow_headers=["*"]))
    return Starlette(
        lifespan=lifespan,
        middleware=middleware,
        routes=routes,
        exception_handlers={HTTPException: _http_error, Exception: _internal_error},
    )
