"""What a failed hub call becomes: one line naming the repository, the file and the fix
(a gated or missing repository, a refused token, an unreachable hub, a stall)."""

import re
from typing import Optional

from .names import HubError, HubId, cache_dir, endpoint, offline, stall_seconds


class Stalled(HubError):
    """The hub answered, then stopped sending: the file and the bytes it got are named."""


class Unreachable(HubError):
    """The hub did not answer (no network, a timeout, HF_HUB_OFFLINE)."""


def one_line(hub_id: HubId, e: BaseException, answered: bool = False) -> HubError:
    """The one-line error of a failed hub call; `answered`: the hub had answered this
    run's earlier calls (then a timeout is a stall, not an unreachable hub)."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, HubError):
        return e
    where = endpoint()
    if answered and is_network_error(e):
        name = file_of(e)
        return Stalled(f"{hub_id}: {name or 'a file'} stalled while downloading: no byte "
                       f"from {where} for {stall_seconds():g} s, six times "
                       f"({type(e).__name__}); the hub answered before, so it is reachable: "
                       f"run again (the download resumes), or raise EDGEMOE_HUB_TIMEOUT")
    if isinstance(e, GatedRepoError):
        return HubError(f"{hub_id}: a gated repository on {where}: accept its terms on "
                        f"{where}/{hub_id.repo}, then set HF_TOKEN to a token of that account")
    if isinstance(e, RevisionNotFoundError):
        return HubError(f"{hub_id}: no revision {hub_id.revision!r} in {hub_id.repo} on {where}")
    if isinstance(e, RepositoryNotFoundError):
        return HubError(f"{hub_id}: no such model folder here, nor a repository on {where} "
                        f"(a private one needs HF_TOKEN)")
    if isinstance(e, HfHubHTTPError) and e.response is not None and \
            e.response.status_code in (401, 403):
        return HubError(f"{hub_id}: {where} refused the token (HTTP "
                        f"{e.response.status_code}); check HF_TOKEN")
    if isinstance(e, (OfflineModeIsEnabled, LocalEntryNotFoundError)) or offline():
        if offline():
            return Unreachable(f"{hub_id}: no such model folder here, nor in the hub cache "
                                f"({cache_dir()}), and HF_HUB_OFFLINE is set: download it "
                                f"once online")
        return Unreachable(f"{hub_id}: no such model folder here, nor in the hub cache "
                            f"({cache_dir()}), and {where} cannot be reached: check the "
                            f"network (or HF_ENDPOINT)")
    if is_network_error(e):
        return Unreachable(f"{hub_id}: no such model folder here, and {where} cannot be "
                            f"reached ({type(e).__name__}): check the network (or HF_ENDPOINT)")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, EntryNotFoundError) or status == 404:
        name = file_of(e)
        return HubError(f"{hub_id}: {name or 'a file'} not found in {hub_id.repo} on {where} "
                        f"(HTTP 404): the repository lists it, but the hub does not serve it")
    if isinstance(e, HfHubHTTPError):
        later = "; try again later" if status is None or status >= 500 or status == 429 else ""
        return HubError(f"{hub_id}: {where} answered HTTP {status or '?'}{later}")
    if isinstance(e, OSError) and e.errno == 28:  # ENOSPC mid-download
        return HubError(f"{hub_id}: the disk filled while downloading into {cache_dir()}: "
                        f"free some space, then run again (the download resumes)")
    return HubError(f"{hub_id}: download failed: {' '.join(str(e).split()) or type(e).__name__}")


def file_of(e: BaseException) -> Optional[str]:
    """The file a failed request asked for (from its URL), if the error carries it."""
    for holder in (e, getattr(e, "response", None)):
        try:  # (httpx raises RuntimeError for a request it was not given)
            url = str(holder.request.url)
            break
        except (AttributeError, RuntimeError):
            continue
    else:
        return None
    match = re.search(r"/resolve/[^/]+/([^?]+)", url)
    return match[1] if match else None


def is_network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError",
                         "RemoteProtocolError", "ConnectionError", "ProtocolError"})
