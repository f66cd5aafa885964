"""Whose prompt-cache entries a request may use (`--prompt-cache-scope`).

`cached_tokens` in a reply's usage (and its time to first token) tells whether the
server had already seen the prompt's beginning. With one cache for everyone, a user can
probe whether another user's prompt started a given way. A scope closes that: a request
reuses, and reveals, only prefixes of requests of its own scope.

- `key` (the default): requests with the same API key (Authorization: Bearer, or
  x-api-key) share; requests without one share with each other.
- `client`: requests from the same address share (whatever their key).
- `shared`: every request shares (most reuse; for one user or a trusted team).

The trade-off: the narrower the scope, the less reuse (two users with the same long
system prompt each prefill it once), and the more entries kept. Scopes are stored as
hashes, never as keys."""

import hashlib

from starlette.requests import Request

SCOPES = ("key", "client", "shared")


def cache_scope(request: Request, mode: str) -> str:
    if mode == "shared":
        return ""
    if mode == "client":
        who = "client:" + (request.client.host if request.client else "")
    else:
        auth = request.headers.get("authorization", "")
        who = "key:" + (auth.removeprefix("Bearer ").strip() if auth else
                        request.headers.get("x-api-key", ""))
    return hashlib.sha256(who.encode()).hexdigest()[:24]
