"""Every refused request leaves a log line: a client whose agent shows only "400" (or shows
nothing) can be told from the server's log which field of which request was refused.

An ASGI middleware reads the status and the (JSON) body of each response whose status is
4xx, and logs at WARNING: the status, method and path, the client (its address and its
User-Agent, which names the agent and its version) and the error's message, which names
the field (every API's BadRequest does)."""

import json
import logging

log = logging.getLogger("edgemoe.server")
MAX_LOGGED_BODY = 64 * 1024  # an error body is small; a larger one is not read for the log


class LogRefusals:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        seen = {"status": 0, "body": b""}

        async def watch(message):
            if message["type"] == "http.response.start":
                seen["status"] = message["status"]
            elif (message["type"] == "http.response.body"
                  and 400 <= seen["status"] < 500 and len(seen["body"]) < MAX_LOGGED_BODY):
                seen["body"] += message.get("body", b"")
                if not message.get("more_body"):
                    log_refusal(scope, seen["status"], seen["body"])
            await send(message)

        await self.app(scope, receive, watch)


def log_refusal(scope, status: int, body: bytes):
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else "?"
    agent = dict(scope.get("headers") or []).get(b"user-agent", b"-").decode("latin-1")
    log.warning("%d %s %s from %s (%s): %s", status, scope.get("method"), scope.get("path"),
                address, agent[:120], error_message(body))


def error_message(body: bytes) -> str:
    """The message of any API's error shape (OpenAI's, Anthropic's, Ollama's)."""
    try:
        error = json.loads(body)
    except ValueError:
        return body[:300].decode("utf-8", "replace")
    while isinstance(error, dict) and "error" in error:
        error = error["error"]
    if isinstance(error, dict):
        error = error.get("message", error)
    return str(error)[:500]
