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
"""

import fnmatch
import json
import os
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Tuple, Union

# the files mlx-lm's own loader fetches, less custom code (*.py): edgemoe runs mlx-lm's
# model classes only; and an edgemoe pack's own files
ALLOW_PATTERNS = ["*.json", "model*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken",
                  "tiktoken.model", "*.txt", "experts.bin", "cache_policy.npz",
                  "prerouter/*", "adapter/*"]
HEADER_FILES = ["config.json", "model.safetensors.index.json"]  # what doctor reads whole
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

    if not offline():
        files = _files(hub_id)  # raises the one-line errors while the hub answers
        if files is not None:
            _check_disk(hub_id, files)
    quiet = not progress
    if quiet:
        disable_progress_bars()
    try:
        folder = snapshot_download(hub_id.repo, revision=hub_id.revision,
                                   allow_patterns=ALLOW_PATTERNS)
    except Exception as e:  # huggingface_hub's and httpx's errors: named below
        raise _one_line(hub_id, e) from e
    finally:
        if quiet:
            enable_progress_bars()
    return Path(folder)


def _files(hub_id: HubId) -> Optional[List[Tuple[str, int, str]]]:
    """(file name, size, commit) of the files to download; None when the hub cannot be reached
    (snapshot_download then serves the cache, or says the hub is unreachable)."""
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(hub_id.repo, revision=hub_id.revision, files_metadata=True)
    except Exception as e:
        error = _one_line(hub_id, e)
        if isinstance(error, _Unreachable):
            return None
        raise error from e
    commit = info.sha
    return [(s.rfilename, s.size or 0, commit) for s in info.siblings or ()
            if wanted(s.rfilename)]


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


def _one_line(hub_id: HubId, e: BaseException) -> HubError:
    """The one-line error of a failed hub call."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    if isinstance(e, HubError):
        return e
    where = endpoint()
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
    if isinstance(e, HfHubHTTPError):
        status = e.response.status_code if e.response is not None else "?"
        return HubError(f"{hub_id}: {where} answered HTTP {status}; try again later")
    if isinstance(e, OSError) and e.errno == 28:  # ENOSPC mid-download
        return HubError(f"{hub_id}: the disk filled while downloading into {cache_dir()}: "
                        f"free some space, then run again (the download resumes)")
    return HubError(f"{hub_id}: download failed: {' '.join(str(e).split()) or type(e).__name__}")


def _is_network_error(e: BaseException) -> bool:
    names = {c.__name__ for c in type(e).__mro__}
    return bool(names & {"ConnectError", "TimeoutException", "NetworkError",
                         "RemoteProtocolError", "ConnectionError", "ProtocolError"})


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
    and the file is written as that header followed by a hole up to the file's real size."""
    from huggingface_hub import HfApi, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    if offline():
        raise HubError(f"{hub_id}: HF_HUB_OFFLINE is set; reading a model's headers on the "
                       f"hub needs the network (or download it, and pass its folder)")
    try:
        info = HfApi().model_info(hub_id.repo, revision=hub_id.revision, files_metadata=True)
        commit = info.sha
        sizes = {s.rfilename: s.size or 0 for s in info.siblings or ()}
        weights = sorted(f for f in sizes if fnmatch.fnmatch(f, "model*.safetensors"))
        if "config.json" not in sizes:
            raise HubError(f"{hub_id}: no config.json in the repository: not a model")
        if not weights:
            raise HubError(f"{hub_id}: no safetensors weights (model*.safetensors) in the "
                           f"repository")
        session, headers = get_session(), build_hf_headers()
        folder.mkdir(parents=True, exist_ok=True)
        fetched = 0

        def get(filename, first=None, last=None):
            nonlocal fetched
            url = hf_hub_url(hub_id.repo, filename, revision=commit, endpoint=endpoint())
            extra = {} if first is None else {"Range": f"bytes={first}-{last}"}
            response = session.get(url, headers={**headers, **extra}, follow_redirects=True)
            hf_raise_for_status(response)
            fetched += len(response.content)
            return response.content

        for name in HEADER_FILES:
            if name in sizes:
                (folder / name).write_bytes(get(name))
        for name in weights:
            (n,) = struct.unpack("<Q", get(name, 0, 7)[:8])
            header = get(name, 8, 8 + n - 1)[:n]
            with open(folder / name, "wb") as f:
                f.write(struct.pack("<Q", n) + header)
                f.truncate(sizes[name] or 8 + n)  # a hole: no disk used for the weights
    except Exception as e:
        raise _one_line(hub_id, e) from e
    files = [(f, s) for f, s in sizes.items() if wanted(f)]
    return RemoteModel(hub_id, folder, commit, files, fetched)


def remote_config(model: RemoteModel) -> dict:
    return json.loads((model.folder / "config.json").read_text())
