"""A pack's folder while convert writes it: one convert per destination (a lock), a
marker on what it is writing, what `--overwrite` may replace (a pack or an empty folder,
never the source) and what it carries over (every file convert did not write), and the
swap into place, so an interrupted conversion leaves nothing half-written at DST."""

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import List

from .pack import FORMAT, MANIFEST

_WRITTEN = re.compile(r"(model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json"
                      r"|experts\.bin|manifest\.json(\.tmp)?|config\.json|generation_config\.json"
                      r"|tokenizer\.json|tokenizer_config\.json|tokenizer\.model"
                      r"|special_tokens_map\.json|added_tokens\.json|chat_template\.(jinja|json)"
                      r"|vocab\.(json|txt)|merges\.txt|spiece\.model|sentencepiece\.bpe\.model)")


def written_by_convert(pack: Path) -> set:
    """The names in an existing pack that convert wrote: its manifest's "files" list, or,
    for a pack written before the list, the exact names convert writes."""
    try:
        files = json.loads((pack / MANIFEST).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        files = None
    if isinstance(files, dict):
        return set(files) | {MANIFEST}
    return {p.name for p in pack.iterdir() if _WRITTEN.fullmatch(p.name)}


def keep_theirs(dst: Path, tmp: Path) -> List[str]:
    """Carry what convert did not write from the pack it replaces into the new one
    (hard links where the disk allows, else copies: the old pack keeps its own until
    the swap); the names carried."""
    kept, ours = [], written_by_convert(dst)
    for entry in sorted(dst.iterdir()):
        if entry.name in ours or (tmp / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, tmp / entry.name, symlinks=True,
                            copy_function=_link_or_copy)
        else:
            _link_or_copy(entry, tmp / entry.name)
        kept.append(entry.name + ("/" if entry.is_dir() else ""))
    return kept


def _link_or_copy(src, dst):
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)
    return dst


class DestinationLock:
    """An exclusive lock on a destination (`.DST.lock` beside it, flock'ed: released when
    its process ends however it ends); a second convert to the same destination is
    refused with one line naming the holder."""

    def __init__(self, dst: Path):
        self.path = dst.parent / f".{dst.name}.lock"
        self.file = None

    def __enter__(self):
        while True:
            f = open(self.path, "a+")
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _holder(f)
                f.close()
                raise FileExistsError(errno.EEXIST, f"another convert is writing this pack "
                                                    f"({holder}); wait for it to end",
                                      str(self.path.parent / self.path.name[1:-5])) from None
            try:  # the file we locked is still the lock (not one a finishing holder removed)
                if os.fstat(f.fileno()).st_ino == os.stat(self.path).st_ino:
                    break
            except FileNotFoundError:
                pass
            f.close()
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on {socket.gethostname()}, started "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}")
        f.flush()
        self.file = f
        return self

    def __exit__(self, *exc):
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.file.close()  # releases the flock


def _holder(f, wait_s: float = 2.0) -> str:
    """The line the lock's holder wrote on itself. It writes it just after taking the lock,
    so a lock found taken but still empty is read again for a moment before giving up."""
    deadline = time.monotonic() + wait_s
    while True:
        f.seek(0)
        holder = f.read().strip()
        if holder or time.monotonic() > deadline:
            return holder or "another process"
        time.sleep(0.02)


OURS = ".edgemoe-partial"  # marks a folder this tool is writing


def check_destination(src: Path, dst: Path, overwrite: bool):
    """Refuse a destination that would destroy what convert did not write: the source,
    a folder holding it or inside it, a file, or a folder that is not an edgemoe pack."""
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents or d in s.parents:
        where = ("is the source" if d == s else "is inside the source" if s in d.parents
                 else "contains the source")
        raise ValueError(f"--mlx-path {dst}: {where} {src}; write the pack elsewhere")
    if not dst.exists() and not dst.is_symlink():
        return
    if not overwrite:
        raise FileExistsError(f"{dst}: already exists; pass --overwrite to replace it")
    if not dst.is_dir() or dst.is_symlink():
        raise FileExistsError(f"--overwrite {dst}: not a folder; --overwrite replaces only "
                              f"an edgemoe pack or an empty folder")
    if any(dst.iterdir()) and not is_pack(dst):
        raise FileExistsError(f"--overwrite {dst}: not an edgemoe pack (no edgemoe "
                              f"manifest.json); --overwrite replaces only an edgemoe pack or "
                              f"an empty folder")


def is_pack(path: Path) -> bool:
    try:
        return json.loads((path / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def remove_ours(path: Path, what: str):
    """Remove a folder this tool left (marked, or a pack), and say so; refuse any other."""
    if not path.exists():
        return
    if not (path / OURS).exists() and not is_pack(path):
        raise FileExistsError(f"{path}: in the way, and not written by edgemoe.convert; "
                              f"move it")
    print(f"[edgemoe] removing {what}: {path}", file=sys.stderr)
    shutil.rmtree(path)


def replace_with(tmp: Path, dst: Path):
    """Move the finished pack into place; an old DST goes only once the new one is whole."""
    old = dst.parent / f".{dst.name}.old"
    remove_ours(old, "the pack an interrupted --overwrite replaced")  # (under the lock)
    (tmp / OURS).unlink()
    if dst.exists():
        dst.rename(old)
    tmp.rename(dst)
    if old.exists():
        shutil.rmtree(old)
