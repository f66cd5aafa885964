"""The resident weights' safetensors files: headers read with every entry checked, and
the CRC32 of each tensor (what the manifest records and `verify` checks)."""

import json
import os
import zlib
from pathlib import Path
from typing import Dict, Optional, Tuple

import numpy as np

from .records import PackError, count

MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit


def resident_checksums(path: Path, chunk: int = 16 * 2**20, names: Optional[set] = None,
                       uncached: bool = False) -> Dict[str, int]:
    """CRC32 of every tensor's bytes in a safetensors file (of `names` only, if given),
    read in chunks; with `uncached`, each chunk's pages dropped once read."""
    header, start = safetensors_header(path)
    with open(path, "rb") as f:
        crcs = {}
        for name, (begin, end) in header.items():
            if names is not None and name not in names:
                continue
            f.seek(start + begin)
            crc, left = 0, end - begin
            while left:
                data = f.read(min(chunk, left))
                if not data:
                    raise PackError(f"{path}: truncated inside tensor {name}")
                crc, left = zlib.crc32(data, crc), left - len(data)
                if uncached and hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(f.fileno(), f.tell() - len(data), len(data),
                                     os.POSIX_FADV_DONTNEED)
            crcs[name] = crc
    return crcs


def resident_tensor_names(path: Path, expert_paths) -> set:
    """The tensors of a shard that are not routed experts."""
    return {name for name in read_safetensors_header(Path(path))[0]
            if expert_of(name, expert_paths) is None}


def expert_of(name: str, expert_paths):
    """(expert module path, tensor name within it) of a routed-expert tensor, else None."""
    for module in expert_paths:
        if name.startswith(module + "."):
            return module, name[len(module) + 1:]
    return None


def safetensors_header(path: Path) -> Tuple[Dict[str, Tuple[int, int]], int]:
    """({tensor: (begin, end) of its bytes}, where the data starts) of a safetensors file,
    checked as `read_safetensors_header` checks it."""
    entries, start = read_safetensors_header(path)
    return {name: tuple(e["data_offsets"]) for name, e in entries.items()}, start


def read_safetensors_header(path: Path) -> Tuple[Dict[str, dict], int]:
    """({tensor: its header entry}, where the data starts) of a safetensors file, every
    entry checked (inside the file, a known dtype, a shape of its size, no two
    overlapping): a damaged header is a one-line PackError, never a huge read, a
    recursion or a C++ exception in the loader."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PackError(f"{path}: not a safetensors file (too short)")
        length = int.from_bytes(raw, "little")
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise PackError(f"{path}: header of {length} bytes in a file of {size}; damaged")
        try:
            header = json.loads(f.read(length))
        except (ValueError, RecursionError) as e:
            why = " ".join(str(e).split())[:80] or type(e).__name__
            raise PackError(f"{path}: damaged header (not JSON: {why})") from None
    start = 8 + length
    if not isinstance(header, dict):
        raise PackError(f"{path}: damaged header (not a JSON object)")
    header.pop("__metadata__", None)
    spans, out = [], {}
    for name, entry in header.items():
        try:
            dtype, shape, (begin, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            for n in (*shape, begin, end):
                count(n, "an offset or shape entry", f"{path}: tensor {name}")
        except PackError:
            raise
        except (TypeError, ValueError, KeyError):
            raise PackError(f"{path}: tensor {name}: damaged header entry "
                            f"{json.dumps(entry)[:80]}") from None
        itemsize = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2,
                    "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8,
                    "I64": 8, "F64": 8, "C64": 8}.get(dtype)
        if itemsize is None:
            raise PackError(f"{path}: tensor {name}: unknown dtype {str(dtype)[:20]!r}")
        if end < begin or start + end > size:
            raise PackError(f"{path}: tensor {name}: bytes {begin}..{end} outside the "
                            f"file's {size - start} bytes of data")
        if int(np.prod(shape, dtype=object)) * itemsize != end - begin:
            raise PackError(f"{path}: tensor {name}: shape {shape} of {dtype} does not take "
                            f"its {end - begin} bytes")
        spans.append((begin, end, name))
        out[name] = entry
    spans.sort()
    for (_, end, a), (begin, _, b) in zip(spans, spans[1:]):
        if begin < end:
            raise PackError(f"{path}: tensor {b} overlaps tensor {a}")
    return out, start
