"""Models named by a Hugging Face hub id (`org/name`, or `org/name@revision`).

Every tool's `--model` (and `edgemoe.load`) takes a local model folder or a hub id. A hub
id is downloaded once with huggingface_hub into the user's hub cache (HF_HOME, or
HF_HUB_CACHE), only the files a model needs (config, tokenizer, safetensors weights and
their index, chat template; a pack's experts file and trained assets), then run in place
as any local folder. huggingface_hub does the work: resumable downloads (an interrupted
file continues from its `.incomplete` part), a progress bar, `HF_TOKEN`, `HF_ENDPOINT`,
and `HF_HUB_OFFLINE=1` (the cache only). What edgemoe adds: the disk space is checked
against the files' sizes before any download, and the expected failures are one line.

`remote_headers` is the other way in, for `edgemoe.doctor`: config.json and the
safetensors headers only (HTTP range requests), laid out in a temporary folder as sparse
files of the real sizes, so that the same code that opens a local checkpoint sizes one
on the hub without downloading its weights.

Every byte edgemoe itself asks the hub for goes through `fetch`: one call with a deadline
(EDGEMOE_HUB_TIMEOUT seconds without a byte, default 10 as huggingface_hub's own; the
whole call within EDGEMOE_HUB_DEADLINE, default 120) and a limit on its size, checked
against what the hub declares (a listing's size, a Content-Length, a header's length
field) before the body is read. huggingface_hub's own downloads run under the same
per-read timeout. A call that stalls says which file stalled and after how many bytes;
a hub that never answered is "cannot be reached".
"""

import fnmatch
import json
import os
import re
import shutil
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

# the files mlx-lm's own loader fetches, less custom code (*.py): edgemoe runs mlx-lm's
# model classes only; and an edgemoe pack's own files
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "experts.bin", "cache_policy.npz",
                  "prerouter/*", "adapter/*"]
HEADER_FILES = ["config.json", "model.safetensors.index.json"]  # what doctor reads whole
MAX_HEADER_FILE_BYTES = 64 * 2**20  # config.json, the index: the largest real ones are ~10 MB
MAX_LISTING_BYTES = 64 * 2**20  # a repository's file list (model info)
MAX_SAFETENSORS_HEADER = 100 * 2**20  # safetensors' own limit
_REPO_ID = re.compile(r"(?P<repo>[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9_.-]+)"
                      r"(?:@(?P<revision>[A-Za-z0-9_./-]+))?")


class HubError(ValueError):
    """An expected failure of a hub download: one line, naming the repository and the fix."""


@dataclass(frozen=True)
class HubId:
    repo: str
    revision: Optional[str] = None  # None: the default branch

    def __str__(self):
        return self.repo + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(name) -> Optional[HubId]:
    """The hub id `name` spells, or None when it names a local path (one that exists, or
    that cannot be a hub id: absolute, ./relative, more than one slash)."""
    if name is None or isinstance(name, Path):
        return None
    text = str(name)
    if os.path.exists(text) or text.startswith((".", "/", "~")):
        return None
    match = _REPO_ID.fullmatch(text)
    if match is None or ".." in match["repo"]:
        return None
    return HubId(match["repo"], match["revision"])


def resolve(name, progress: bool = True) -> Union[Path, str, None]:
    """A local model folder for `name`: a hub id is downloaded into the hub cache (or found
    there, offline); anything else is returned as it was given."""
    hub_id = parse_hub_id(name)
    if hub_id is None:
        return name
    return download(hub_id, progress=progress)


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT.rstrip("/")


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def wanted(filename: str) -> bool:
    return any(fnmatch.fnmatch(filename, p) for p in ALLOW_PATTERNS)


def free_bytes(folder: Path) -> int:
    """Free space on the file system that holds `folder` (or would, once made)."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    return shutil.disk_usage(folder).free


def download(hub_id: HubId, progress: bool = True) -> Path:
    """The snapshot folder of `hub_id` in the hub cache, downloaded if need be."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import disable_progress_bars, enable_progress_bars

    files = None
    if not offline():
        files = _files(hub_id)  # raises the one-line errors while the hub answers
        if files is not None:
            _check_disk(hub_id, files)
    quiet = not progress
    if quiet:
        disable_progress_bars()
    try:
        with _read_timeouts():
            folder = snapshot_download(hub_id.repo, revision=hub_id.revision,
                                       allow_patterns=ALLOW_PATTERNS,
                                       etag_timeout=stall_seconds())
    except Exception as e:  # huggingface_hub's and httpx's errors: named below
        raise _one_line(hub_id, e, answered=files is not None if not offline() else False) \
            from e
    finally:
        if quiet:
            enable_progress_bars()
    return Path(folder)


class _read_timeouts:
    """huggingface_hub's own downloads under edgemoe's per-read timeout (it retries a
    stalled file five times, resuming: a stall ends it after about six timeouts)."""

    def __enter__(self):
        from huggingface_hub import constants

        self.saved = constants.HF_HUB_DOWNLOAD_TIMEOUT, constants.HF_HUB_ETAG_TIMEOUT
        constants.HF_HUB_DOWNLOAD_TIMEOUT = constants.HF_HUB_ETAG_TIMEOUT = stall_seconds()

    def __exit__(self, *exc):
        from huggingface_hub import constants

        constants.HF_HUB_DOWNLOAD_TIMEOUT, constants.HF_HUB_ETAG_TIMEOUT = self.saved


def _files(hub_id: HubId) -> Optional[List[Tuple[str, int, str]]]:
    """(file name, size, commit) of the files to download; None when the hub cannot be reached
    (snapshot_download then serves the cache, or says the hub is unreachable)."""
    try:
        commit, sizes = listing(hub_id)
    except Exception as e:
        error = _one_line(hub_id, e)
        if isinstance(error, _Unreachable):
            return None
        raise error from e
    return [(name, size, commit) for name, size in sizes.items() if wanted(name)]


def _check_disk(hub_id: HubId, files):
    """Refuse a download that cannot fit, before its first byte: the files not yet in the
    cache against the free space where the cache is."""
    from huggingface_hub import try_to_load_from_cache

    missing = 0
    for filename, size, commit in files:
        cached = try_to_load_from_cache(hub_id.repo, filename, revision=commit)
        if not isinstance(cached, str):
            missing += size
    free = free_bytes(cache_dir())
    if missing > free:
        from .streaming.budget import fmt_bytes

        raise HubError(f"{hub_id}: needs {fmt_bytes(missing)} of disk for its files, "
                       f"{fmt_bytes(free)} free in {cache_dir()} (free some space, or set "
                       f"HF_HOME to a larger disk)")
    total = sum(size for _, size, _ in files)
    if missing:
        from .streaming.budget import fmt_bytes

        print(f"[edgemoe] {hub_id}: downloading {len(files)} files ({fmt_bytes(missing)} of "
              f"{fmt_bytes(total)}) into {cache_dir()}", file=sys.stderr)


class _Unreachable(HubError):
    """The hub did not answer (no network, a timeout, HF_HUB_OFFLINE)."""


def _one_line(hub_id: HubId, e: BaseException, answered: bool = False) -> HubError:
    """The one-line error of a failed hub call; `answered`: the hub had answered this
    run's earlier calls (then a timeout is a stall, not an unreachable hub)."""
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, HubError):
        return e
    where = endpoint()
    if answered and _is_network_error(e):
        name = _file_of(e)
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
            return _Unreachable(f"{hub_id}: no such model folder here, nor in the hub cache "
                                f"({cache_dir()}), and HF_HUB_OFFLINE is set: download it "
                                f"once online")
        return _Unreachable(f"{hub_id}: no such model folder here, nor in the hub cache "
                            f"({cache_dir()}), and {where} cannot be reached: check the "
                            f"network (or HF_ENDPOINT)")
    if _is_network_error(e):
        return _Unreachable(f"{hub_id}: no such model folder here, and {where} cannot be "
                            f"reached ({type(e).__name__}): check the network (or HF_ENDPOINT)")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, EntryNotFoundError) or status == 404:
        name = _file_of(e)
        return HubError(f"{hub_id}: {name or 'a file'} not found in {hub_id.repo} on {where} "
                        f"(HTTP 404): the repository lists it, but the hub does not serve it")
    if isinstance(e, HfHubHTTPError):
        later = "; try again later" if status is None or status >= 500 or status == 429 else ""
        return HubError(f"{hub_id}: {where} answered HTTP {status or '?'}{later}")
    if isinstance(e, OSError) and e.errno == 28:  # ENOSPC mid-download
        return HubError(f"{hub_id}: the disk filled while downloading into {cache_dir()}: "
                        f"free some space, then run again (the download resumes)")
    return HubError(f"{hub_id}: download failed: {' '.join(str(e).split()) or type(e).__name__}")


def _file_of(e: BaseException) -> Optional[str]:
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


def _is_network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError",
                         "RemoteProtocolError", "ConnectionError", "ProtocolError"})


# --- one bounded, deadlined fetch for every byte edgemoe asks the hub for -------------

class Stalled(HubError):
    """The hub answered, then stopped sending: the file and the bytes it got are named."""


def stall_seconds() -> float:
    return _seconds("EDGEMOE_HUB_TIMEOUT", 10.0)


def deadline_seconds() -> float:
    return _seconds("EDGEMOE_HUB_DEADLINE", 120.0)


def _seconds(name: str, default: float) -> float:
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value <= 86400:
        raise HubError(f"{name}={text[:40]!r}: expected seconds, a number from 0 to 86400")
    return value


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
        if isinstance(e, HubError) or not _is_network_error(e):
            raise
        if "Connect" in type(e).__name__ and not answered:
            raise  # an unreachable hub: _one_line says so
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


# --- doctor: a model on the hub, from its headers alone ---------------------------------

@dataclass
class RemoteModel:
    """What `remote_headers` fetched: a folder of config.json and sparse safetensors files
    (real sizes, real headers, no weights), and the repository's files' sizes."""

    hub_id: HubId
    folder: Path
    commit: str
    files: List[Tuple[str, int]]  # every file a download would fetch, with its size
    fetched_bytes: int  # bytes this look-up read from the hub

    @property
    def download_bytes(self) -> int:
        return sum(size for _, size in self.files)


def remote_headers(hub_id: HubId, folder: Path) -> RemoteModel:
    """Fetch `hub_id`'s config.json (and safetensors index) and each weight file's header
    into `folder`: a header is read with two range requests (its length, then itself),
    and the file is written as that header followed by a hole up to the file's real size.
    Every size the hub declares is checked before the bytes it sizes are fetched."""
    from urllib.parse import quote

    if offline():
        raise HubError(f"{hub_id}: HF_HUB_OFFLINE is set; reading a model's headers on the "
                       f"hub needs the network (or download it, and pass its folder)")
    answered = False
    try:
        commit, sizes = listing(hub_id)
        answered = True
        weights = sorted(f for f in sizes if fnmatch.fnmatch(f, "model*.safetensors"))
        beside = [f for f in weights if "/" not in f]  # what mlx-lm loads: beside config.json
        if "config.json" not in sizes:
            raise HubError(f"{hub_id}: no config.json in the repository: not a model")
        if not beside:
            elsewhere = f" (only in subfolders: {', '.join(weights[:2])}; mlx-lm loads " \
                        f"those beside config.json)" if weights else ""
            raise HubError(f"{hub_id}: no safetensors weights (model*.safetensors) beside "
                           f"config.json in the repository{elsewhere}")
        folder.mkdir(parents=True, exist_ok=True)
        fetched = 0

        def get(name, limit, first=None, last=None):
            nonlocal fetched
            url = f"{endpoint()}/{hub_id.repo}/resolve/{commit}/{quote(name)}"
            data = fetch(hub_id, name, url, limit, first, last)
            fetched += len(data)
            return data

        for name in HEADER_FILES:
            if name not in sizes:
                continue
            if sizes[name] > MAX_HEADER_FILE_BYTES:
                raise HubError(f"{hub_id}: {name}: the hub lists {sizes[name]} bytes, more "
                               f"than a {name} can take ({MAX_HEADER_FILE_BYTES}); refused "
                               f"before fetching it")
            (folder / name).write_bytes(get(name, MAX_HEADER_FILE_BYTES))
        for name in beside:
            size = sizes[name]
            raw = get(name, 8, 0, 7)
            if len(raw) < 8:
                raise HubError(f"{hub_id}: {name}: {len(raw)} bytes where its header's "
                               f"length should be; damaged")
            (n,) = struct.unpack("<Q", raw)
            if n > min(MAX_SAFETENSORS_HEADER, max(size - 8, 0) if size else n) or n < 2:
                raise HubError(f"{hub_id}: {name}: its header claims {n} bytes in a file of "
                               f"{size} (safetensors allows {MAX_SAFETENSORS_HEADER}): damaged; "
                               f"refused before fetching it")
            header = get(name, n, 8, 8 + n - 1)
            if len(header) != n:
                raise HubError(f"{hub_id}: {name}: the hub sent {len(header)} bytes of its "
                               f"{n}-byte header; damaged or cut")
            with open(folder / name, "wb") as f:
                f.write(raw + header)
                f.truncate(size or 8 + n)  # a hole: no disk used for the weights
    except Exception as e:
        raise _one_line(hub_id, e, answered) from e
    files = [(f, s) for f, s in sizes.items() if wanted(f)]
    return RemoteModel(hub_id, folder, commit, files, fetched)


def remote_config(model: RemoteModel) -> dict:
    return json.loads((model.folder / "config.json").read_text())
