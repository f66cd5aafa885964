"""Prefilled KV caches on disk (`--prompt-cache-dir`): an agent's next turn, or the same
conversation after a restart, prefills only its new tokens.

One file per entry, mlx-lm's own prompt-cache file (`save_prompt_cache`: safetensors, the
KV arrays and the cache classes), with the entry's tokens and scope in its metadata. The
folder holds one subfolder per identity (the model's files, adapter and routing), so a
cache is never used with another model or routing than the one that made it.

- Complete or absent: an entry is written under a temporary name, fsynced, renamed into
  place (atomic on POSIX), and the folder fsynced. A crash leaves at most a temporary file,
  never a partial entry; stale temporary files are removed at start.
- Several processes may share the folder: names are unique per write, a reader that finds
  an entry gone (evicted by another) takes it as a miss, and the index is refreshed when
  the folder changes.
- LRU within a byte cap: using an entry touches its modification time; after each write
  the oldest entries go until the folder is within the cap.
- Scoped: each entry records its scope (a hash: the API key, the client, or none, as
  --prompt-cache-scope says); a request only ever sees entries of its own scope.
"""

import hashlib
import json
import logging
import os
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mlx_lm.models.cache import (can_trim_prompt_cache, load_prompt_cache,
                                 save_prompt_cache, trim_prompt_cache)

log = logging.getLogger("edgemoe.server")
SUFFIX = ".safetensors"
TMP_MARK = ".tmp-"  # a write in progress: ".tmp-<pid>-<random>.safetensors"
STALE_TMP_S = 600  # a temporary file this old belongs to a write that died


@dataclass
class Entry:
    path: Path
    scope: str
    tokens: List[int]
    size: int


def identity_key(identity: dict) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:20]


def entry_name(scope: str, tokens: List[int]) -> str:
    digest = hashlib.sha256(scope.encode() + b"\0" + json.dumps(tokens).encode())
    return digest.hexdigest()[:32] + SUFFIX


def read_metadata(path: Path) -> dict:
    """A safetensors file's metadata, read from its header alone (not its arrays)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return header.get("__metadata__", {})


class DiskPromptCache:
    def __init__(self, folder: Path, identity: dict, max_bytes: int):
        self.folder = Path(folder).expanduser() / identity_key(identity)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.entries: Dict[str, Entry] = {}
        self.seen_mtime = None
        self._write_identity(identity)
        self._remove_stale_temporaries()
        self.refresh()

    # -- the index -------------------------------------------------------------------------
    def refresh(self):
        """Index the entries of the folder (another process may have added or evicted
        some); only new files' headers are read."""
        mtime = os.stat(self.folder).st_mtime_ns
        if mtime == self.seen_mtime:
            return
        self.seen_mtime = mtime
        names = {p.name for p in self.folder.glob("*" + SUFFIX) if TMP_MARK not in p.name}
        for gone in set(self.entries) - names:
            del self.entries[gone]
        for name in names - set(self.entries):
            path = self.folder / name
            try:
                meta = read_metadata(path)
                self.entries[name] = Entry(path, meta["0.scope"], json.loads(meta["0.tokens"]),
                                           path.stat().st_size)
            except FileNotFoundError:
                continue  # evicted meanwhile
            except (KeyError, ValueError, struct.error) as e:
                log.warning("prompt cache: %s is not an entry of ours (%s); left alone",
                            path, e)

    def nearest(self, scope: str, tokens: List[int]) -> Tuple[Optional[Entry], int]:
        """The entry of `scope` sharing the longest prefix with `tokens`, and its length."""
        self.refresh()
        best, length = None, 0
        for entry in self.entries.values():
            if entry.scope != scope:
                continue
            n = len(os.path.commonprefix([entry.tokens, tokens]))
            if n > length:
                best, length = entry, n
        return best, length

    # -- reading and writing ---------------------------------------------------------------
    def load(self, scope: str, tokens: List[int], better_than: int):
        """(the KV cache of the longest prefix of `tokens` on disk, its length), or
        (None, 0) when none is longer than `better_than` tokens."""
        entry, length = self.nearest(scope, tokens)
        if entry is None or length <= better_than:
            return None, 0
        try:
            cache = load_prompt_cache(str(entry.path))
            os.utime(entry.path)  # used: the last to be evicted
        except (FileNotFoundError, ValueError, RuntimeError) as e:
            log.info("prompt cache: %s unreadable (%s); a miss", entry.path.name, e)
            self.entries.pop(entry.path.name, None)
            return None, 0
        if length < len(entry.tokens):
            if not can_trim_prompt_cache(cache):
                return None, 0
            trim_prompt_cache(cache, len(entry.tokens) - length)
        return cache, length

    def save(self, scope: str, tokens: List[int], cache: list):
        """Write the entry (complete or not at all), drop entries of the scope it makes
        redundant (its prefixes, when a cache can be trimmed), and keep within the cap."""
        name = entry_name(scope, tokens)
        path = self.folder / name
        if path.exists():
            os.utime(path)
            return
        tmp = self.folder / f"{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}{SUFFIX}"
        try:
            save_prompt_cache(str(tmp), cache, {"scope": scope, "tokens": json.dumps(tokens)})
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
            self._fsync_folder()
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        self.entries[name] = Entry(path, scope, list(tokens), path.stat().st_size)
        if can_trim_prompt_cache(cache):
            for other in list(self.entries.values()):
                if (other.scope == scope and other.path != path
                        and len(other.tokens) < len(tokens)
                        and tokens[:len(other.tokens)] == other.tokens):
                    self._remove(other)
        self._evict()

    # -- upkeep ----------------------------------------------------------------------------
    def nbytes(self) -> int:
        return sum(e.size for e in self.entries.values())

    def _evict(self):
        """The least recently used entries go until the folder is within its cap."""
        self.refresh()
        by_use = []
        for entry in self.entries.values():
            try:
                by_use.append((entry.path.stat().st_mtime, entry))
            except FileNotFoundError:
                continue
        total = sum(e.size for _, e in by_use)
        for _, entry in sorted(by_use, key=lambda pair: pair[0]):
            if total <= self.max_bytes:
                break
            total -= entry.size
            self._remove(entry)

    def _remove(self, entry: Entry):
        entry.path.unlink(missing_ok=True)
        self.entries.pop(entry.path.name, None)

    def _fsync_folder(self):
        fd = os.open(self.folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_identity(self, identity: dict):
        """What made these entries, for a person reading the folder."""
        path = self.folder / "identity.json"
        if not path.exists():
            tmp = self.folder / f"{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:12]}.json"
            tmp.write_text(json.dumps(identity, indent=1, sort_keys=True))
            os.replace(tmp, path)

    def _remove_stale_temporaries(self):
        """Temporary files of writes that died (a crash mid-write) long ago; a live
        write's (another process's) is younger."""
        now = time.time()
        for p in self.folder.glob(TMP_MARK + "*"):
            try:
                if now - p.stat().st_mtime > STALE_TMP_S:
                    p.unlink()
            except FileNotFoundError:
                pass
