"""Checksums for an mlx-lm checkpoint read in place, kept in a small index beside it.

A pack's manifest carries a CRC32 per expert record and per resident tensor. An mlx-lm
checkpoint carries none, so `python -m edgemoe.verify` computes them once into
`edgemoe.checksums.json` in the checkpoint's folder (the only file edgemoe writes
there). From then on its experts are checked as they are read, and its resident tensors
at load, as a pack's are. The index names each shard by size and header hash: a shard
replaced since is reported, and the index rebuilt with `edgemoe.verify --rebuild`.
"""

import hashlib
import json
import os
import struct
import zlib
from dataclasses import replace
from pathlib import Path
from typing import Callable, Dict, List, Optional

from .pack import Pack, PackError, read_json, resident_checksums
from .resident import resident_tensor_names

INDEX_FILE = "edgemoe.checksums.json"
FORMAT = "edgemoe.checksums"
VERSION = 1
CHUNK = 16 * 2**20


def shard_identity(files: List[Path]) -> Dict[str, dict]:
    """Each shard's size and a hash of its safetensors header (names, shapes, offsets)."""
    found = {}
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = fh.read(n)
        found[f.name] = {"size": f.stat().st_size,
                         "header_sha256": hashlib.sha256(header).hexdigest()[:16]}
    return found


def record_crc32(fds: List[int], record) -> int:
    """The CRC32 of a record's segments, in order: what the reader computes."""
    crc = 0
    for file_index, offset, length in record.segments:
        while length:
            data = os.pread(fds[file_index], min(CHUNK, length), offset)
            if not data:
                raise PackError(f"truncated at offset {offset}")
            crc = zlib.crc32(data, crc)
            offset, length = offset + len(data), length - len(data)
    return crc


def expert_crc32s(pack: Pack, progress: Callable[[int], None] = lambda n: None):
    """The CRC32 of every expert record, by layer module: read from disk, record by
    record; `progress(bytes)` after each."""
    fds = [os.open(f, os.O_RDONLY) for f in pack.files]
    try:
        out = {}
        for layer in pack.layers:
            out[layer.module] = []
            for record in layer.records:
                if record is None:  # another host's expert (a shard)
                    out[layer.module].append(None)
                    continue
                out[layer.module].append(record_crc32(fds, record))
                progress(record.length)
        return out
    finally:
        for fd in fds:
            os.close(fd)


def build_index(pack: Pack, progress: Callable[[int], None] = lambda n: None) -> dict:
    """Compute and write the index of an mlx-lm checkpoint read in place (atomically);
    return it."""
    resident, experts = {}, [layer.module for layer in pack.layers]
    for f in pack.files:
        resident.update(resident_checksums(f, names=resident_tensor_names(f, experts)))
    index = {"format": FORMAT, "version": VERSION, "shards": shard_identity(pack.files),
             "experts": expert_crc32s(pack, progress), "resident": resident}
    path = pack.path / INDEX_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(index))
    os.replace(tmp, path)
    return index


def load_index(pack: Pack) -> Optional[dict]:
    """The index beside an mlx-lm checkpoint, or None; a PackError if it is malformed or
    its shards changed since it was built."""
    path = pack.path / INDEX_FILE
    if not path.exists():
        return None
    rebuild = f"rebuild it with `python -m edgemoe.verify --model {pack.path} --rebuild`"
    try:
        index = read_json(path)
        kind, shards, experts = (index["format"], index["version"]), index["shards"], \
            index["experts"]
        index["resident"] = dict(index["resident"])
    except PackError as e:
        raise PackError(f"{e}; {rebuild}") from None
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise PackError(f"{path}: malformed ({e}); {rebuild}") from None
    if kind != (FORMAT, VERSION):
        raise PackError(f"{path}: not an edgemoe checksum index of version {VERSION}; "
                        f"{rebuild}")
    now = shard_identity(pack.files)
    if shards != now:
        changed = sorted(set(shards) ^ set(now) | {n for n in now if shards.get(n) != now[n]})
        raise PackError(f"{path}: {', '.join(changed)} changed since the index was built; "
                        f"{rebuild}")
    for layer in pack.layers:
        crcs = experts.get(layer.module)
        if not isinstance(crcs, list) or len(crcs) != layer.num_experts:
            raise PackError(f"{path}: no checksums for {layer.module}; {rebuild}")
    return index


def with_index(pack: Pack, index: dict) -> Pack:
    """The pack with the index's checksums on its records and resident tensors."""
    for layer in pack.layers:
        crcs = index["experts"][layer.module]
        layer.records = [replace(r, crc32=int(c)) for r, c in zip(layer.records, crcs)]
    pack.resident_crc32 = index["resident"]
    return pack
