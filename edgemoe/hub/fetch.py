"""One bounded, deadlined fetch for every byte edgemoe itself asks the hub for (see
edgemoe.hub), and the repository's file list through it."""

import json
import time
from typing import Optional, Tuple

from .failures import Stalled, is_network_error
from .names import HubError, HubId, deadline_seconds, endpoint, stall_seconds

MAX_LISTING_BYTES = 64 * 2**20  # a repository's file list (model info)


def fetch(hub_id: HubId, what: str, url: str, limit: int, first: Optional[int] = None,
          last: Optional[int] = None) -> bytes:
    """GET `url` (its bytes `first`..`last`, if given): at most `limit` bytes, a read
    timeout of EDGEMOE_HUB_TIMEOUT seconds and a deadline of EDGEMOE_HUB_DEADLINE for the
    whole call. A Content-Length over `limit` is refused before the body is read; a
    ranged call stops at its range whatever the hub sends. `what` names the file."""
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    stall, deadline = stall_seconds(), deadline_seconds()
    extra = {} if first is None else {"Range": f"bytes={first}-{last}"}
    started, got, answered = time.monotonic(), bytearray(), False
    try:
        with get_session().stream("GET", url, headers={**build_hf_headers(), **extra},
                                  timeout=stall, follow_redirects=True) as response:
            answered = True
            if response.status_code >= 400:
                hf_raise_for_status(_whole(response, _head(response, 65536)))
            if first and response.status_code != 206:
                raise HubError(f"{hub_id}: {what}: the hub ignored a range request (HTTP "
                               f"{response.status_code}); cannot read its header alone")
            declared = response.headers.get("Content-Length", "")
            if first is None and declared.isdigit() and int(declared) > limit:
                raise HubError(f"{hub_id}: {what}: the hub declares {int(declared)} bytes "
                               f"(Content-Length), more than {limit} a {what} can take; "
                               f"refused before reading it")
            for chunk in response.iter_bytes():
                got += chunk
                if len(got) >= limit and first is not None:
                    return bytes(got[:limit])
                if len(got) > limit:
                    raise HubError(f"{hub_id}: {what}: more than {limit} bytes, more than a "
                                   f"{what} can take; refused (read {len(got)})")
                if time.monotonic() - started > deadline:
                    raise Stalled(f"{hub_id}: {what}: not complete after {deadline:g} s "
                                  f"({len(got)} bytes; EDGEMOE_HUB_DEADLINE)")
    except Exception as e:
        if isinstance(e, HubError) or not is_network_error(e):
            raise
        if "Connect" in type(e).__name__ and not answered:
            raise  # an unreachable hub: failures.one_line says so
        stage = (f"after {len(got)} bytes" if got or answered else
                 "before answering")
        raise Stalled(f"{hub_id}: {what} stalled {stage}: no byte from {endpoint()} for "
                      f"{stall:g} s ({type(e).__name__}); try again, or raise "
                      f"EDGEMOE_HUB_TIMEOUT") from None
    return bytes(got)


def _head(response, limit: int) -> bytes:
    body = bytearray()
    for chunk in response.iter_bytes():
        body += chunk
        if len(body) >= limit:
            break
    return bytes(body[:limit])


def _whole(response, body: bytes):
    """A read response, for huggingface_hub's error mapping (which reads the body)."""
    return type(response)(response.status_code, headers=response.headers, content=body,
                          request=response.request)


def listing(hub_id: HubId) -> Tuple[str, dict]:
    """(commit, {file: size}) of a repository at its revision: the model info call
    huggingface_hub makes (files_metadata), bounded as every fetch is."""
    from urllib.parse import quote

    url = f"{endpoint()}/api/models/{hub_id.repo}"
    if hub_id.revision is not None:
        url += f"/revision/{quote(hub_id.revision, safe='')}"
    data = fetch(hub_id, "the repository's file list", url + "?blobs=true", MAX_LISTING_BYTES)
    try:
        info = json.loads(data)
        commit = info["sha"]
        sizes = {s["rfilename"]: _size(s.get("size")) for s in info.get("siblings") or ()}
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
        raise HubError(f"{hub_id}: the hub's file list is malformed (from {url})") from None
    if not isinstance(commit, str) or not all(isinstance(n, str) for n in sizes):
        raise HubError(f"{hub_id}: the hub's file list is malformed (from {url})")
    return commit, sizes


def _size(value) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TypeError(value)
    return value
