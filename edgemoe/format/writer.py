"""Writing a pack: expert records appended to experts.bin, each aligned, and the manifest
(edgemoe.convert writes a pack with these; edgemoe.format.deltas a delta file)."""

import hashlib
import json
import os
import zlib
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .config_match import CONFIG, config_fields
from .pack import EXPERTS_FILE, FORMAT, MANIFEST, VERSION
from .records import ALIGNMENT, PackLayer, Record, TensorLayout, aligned, read_json
from .resident import resident_checksums


def record_layout(tensors: Dict[str, np.ndarray], dtypes: Dict[str, str]) -> List[TensorLayout]:
    """Lay one expert's tensors (given stacked over experts) back to back, by name."""
    layout, offset = [], 0
    for name in sorted(tensors):
        per_expert = tensors[name][0]
        layout.append(TensorLayout(name, dtypes[name], tuple(per_expert.shape),
                                   offset, per_expert.nbytes))
        offset += per_expert.nbytes
    return layout


class ExpertsWriter:
    """Appends expert records to experts.bin, each at a 16 KiB boundary."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")
        self.offset = 0

    def write(self, parts: List[np.ndarray], crc: int = 0) -> Record:
        """`crc`: a CRC32 to go on from (an expert's, for its delta: edgemoe.format.deltas)."""
        length = 0
        for part in parts:
            buf = memoryview(np.ascontiguousarray(part)).cast("B")
            self.file.write(buf)
            crc = zlib.crc32(buf, crc)
            length += len(buf)
        record = Record(((0, self.offset, length),), crc)
        self.offset = aligned(self.offset + length)
        self.file.seek(self.offset)
        return record

    def close(self) -> int:
        """Pad the file to its last record's alignment; return its size."""
        self.file.truncate(self.offset)
        self.file.close()
        return self.offset


def record_written_files(path: Path, exclude=()):
    """Add to the pack's manifest the files convert wrote (every file now in `path`, the
    pack being written, less `exclude`): those a later --overwrite may remove, with the
    SHA-256 of each small one (weights, config.json and the manifest have their own
    checks). Atomic, as write_manifest."""
    manifest = read_json(path / MANIFEST)
    heavy = {MANIFEST, CONFIG, EXPERTS_FILE, "model.safetensors.index.json"}
    files = {}
    for f in sorted(path.iterdir()):
        if not f.is_file() or f.name in exclude or f.name.endswith(".tmp"):
            continue
        small = f.name not in heavy and not f.name.endswith(".safetensors")
        files[f.name] = hashlib.sha256(f.read_bytes()).hexdigest() if small else None
    manifest["files"] = files
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / MANIFEST)


def write_manifest(path: Path, model_type: str, top_k: int, layers: List[PackLayer],
                   experts_file_size: int, resident_crc32: Optional[Dict[str, int]] = None,
                   shard: Optional[dict] = None):
    """`resident_crc32` defaults to the checksums of the resident files as they are;
    `shard` describes one host's share (edgemoe.distributed.Partition.shard_info)."""
    files = sorted(path.glob("model*.safetensors"))
    if resident_crc32 is None:
        resident_crc32 = {}
        for f in files:
            resident_crc32.update(resident_checksums(f))
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "model_type": model_type,
        "top_k": top_k,
        "alignment": ALIGNMENT,
        "experts_file": EXPERTS_FILE,
        "experts_file_size": experts_file_size,
        "layers": [l.to_json() for l in layers],
        "resident": {"files": [f.name for f in files], "crc32": resident_crc32},
    }
    if shard is not None:
        manifest["shard"] = shard
    config = path / CONFIG
    if config.exists():  # written before the manifest: its checksum goes in
        manifest["config"] = {"sha256": hashlib.sha256(config.read_bytes()).hexdigest(),
                               "fields": config_fields(read_json(config))}
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, path / MANIFEST)
