"""Downloading a model named by a hub id into the hub cache, once, with huggingface_hub:
the disk checked against the files' sizes first, the failures one line (edgemoe.hub)."""

import shutil
import sys
from pathlib import Path
from typing import List, Optional, Tuple, Union

from .failures import Unreachable, one_line
from .fetch import listing
from .names import (ALLOW_PATTERNS, HubError, HubId, cache_dir, offline, parse_hub_id,
                    stall_seconds, wanted)


def resolve(name, progress: bool = True) -> Union[Path, str, None]:
    """A local model folder for `name`: a hub id is downloaded into the hub cache (or found
    there, offline); anything else is returned as it was given."""
    hub_id = parse_hub_id(name)
    if hub_id is None:
        return name
    return download(hub_id, progress=progress)


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
        raise one_line(hub_id, e, answered=files is not None if not offline() else False) \
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
        error = one_line(hub_id, e)
        if isinstance(error, Unreachable):
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
        from ..streaming.budget import fmt_bytes

        raise HubError(f"{hub_id}: needs {fmt_bytes(missing)} of disk for its files, "
                       f"{fmt_bytes(free)} free in {cache_dir()} (free some space, or set "
                       f"HF_HOME to a larger disk)")
    total = sum(size for _, size, _ in files)
    if missing:
        from ..streaming.budget import fmt_bytes

        print(f"[edgemoe] {hub_id}: downloading {len(files)} files ({fmt_bytes(missing)} of "
              f"{fmt_bytes(total)}) into {cache_dir()}", file=sys.stderr)
