"""A pack's records: one expert's tensors laid back to back (`TensorLayout`), where its
bytes lie (`Record`), a layer's records (`PackLayer`), each record's checksum bound to its
identity (`bound_crc`), and the manifest's JSON read with its bounds checked.

Below every other module of edgemoe.format: the pack (edgemoe.format.pack) opens and
checks them, the writer (edgemoe.format.writer) appends them."""

import json
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

ALIGNMENT = 16 * 1024  # every record starts at a multiple: O_DIRECT reads it whole
MAX_MANIFEST_BYTES = 256 * 2**20
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2,
            "bfloat16": 2, "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8,
            "float64": 8, "complex64": 8}


class PackError(ValueError):
    """A pack is missing, truncated, corrupt, or of another format version."""


def count(value, what: str, where: str) -> int:
    """A manifest integer: an int (not a bool), not negative."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PackError(f"{where}: {what} must be a non-negative integer, found "
                        f"{json.dumps(value)[:40]}")
    return value


def read_json(path: Path, limit: int = MAX_MANIFEST_BYTES):
    """A JSON file as a dict, or a one-line PackError naming it (too large, not JSON,
    nested too deep, not an object)."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise PackError(f"{path}: {size} bytes, more than any edgemoe file of its "
                            f"kind ({limit}); damaged")
        value = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        if isinstance(e, PackError):
            raise
        why = " ".join(str(e).split())[:120] or type(e).__name__
        raise PackError(f"{path}: not valid JSON ({why})") from None
    if not isinstance(value, dict):
        raise PackError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


@dataclass(frozen=True)
class TensorLayout:
    """One tensor inside an expert record: e.g. `gate_proj.scales`."""

    name: str
    dtype: str  # an MLX dtype name: uint32, float32, bfloat16, ...
    shape: tuple
    offset: int  # within the record
    nbytes: int

    @property
    def projection(self) -> str:
        return self.name.rsplit(".", 1)[0]

    @property
    def kind(self) -> str:
        return self.name.rsplit(".", 1)[1]


@dataclass(frozen=True)
class Record:
    """Where one expert's bytes lie: (file index, offset, length) segments, in the
    order of its layer's tensors. A pack's record is one segment with a CRC32; an
    mlx-lm checkpoint read in place has one segment per tensor and no checksum."""

    segments: Tuple[Tuple[int, int, int], ...]
    crc32: Optional[int] = None
    bound: Optional[int] = None  # crc32 bound to the record's identity (bound_crc)

    @property
    def offset(self) -> int:
        return self.segments[0][1]

    @property
    def length(self) -> int:
        return sum(s[2] for s in self.segments)


@dataclass
class PackLayer:
    """The routed experts of one MoE layer: where each record lies and what it holds."""

    module: str  # mlx-lm module path, e.g. model.layers.3.mlp.switch_mlp
    index: int  # decoder layer index
    tensors: List[TensorLayout]
    quantization: Dict[str, Optional[dict]]  # projection -> {group_size, bits, mode}
    records: List[Optional[Record]]  # by expert id; None: another host's (a shard)
    # with an adapter's deltas of the routed experts in its records (edgemoe.format.deltas):
    # their LoRA scale; the deltas' tensors follow the expert's
    lora_scale: Optional[float] = None

    @property
    def num_experts(self) -> int:
        return len(self.records)

    @property
    def owned(self) -> np.ndarray:
        """Which experts this pack holds: all, or one host's share (edgemoe.distributed)."""
        return np.array([r is not None for r in self.records])

    @property
    def num_owned(self) -> int:
        return int(self.owned.sum())

    @property
    def expert_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def delta_bytes(self) -> int:
        """Of `expert_bytes`, an adapter's delta (edgemoe.format.deltas)."""
        return sum(t.nbytes for t in self.tensors if t.kind in ("lora_a", "lora_b"))

    def to_json(self) -> dict:
        return {
            "module": self.module,
            "index": self.index,
            "tensors": [
                {"name": t.name, "dtype": t.dtype, "shape": list(t.shape),
                 "offset": t.offset, "nbytes": t.nbytes}
                for t in self.tensors
            ],
            "quantization": self.quantization,
            "records": [None if r is None else [r.offset, r.length, r.crc32]
                        + ([] if r.crc32 is None else [bound_crc(self.identity, e, r.crc32)])
                        for e, r in enumerate(self.records)],  # one segment each
        }

    @property
    def identity(self) -> int:
        """A CRC32 of what the layer's records mean: its module, index, tensor names,
        dtypes, shapes, offsets and quantization."""
        tensors = [[t.name, t.dtype, list(t.shape), t.offset, t.nbytes] for t in self.tensors]
        text = json.dumps([self.module, self.index, tensors, self.quantization], sort_keys=True)
        return zlib.crc32(text.encode())

    @classmethod
    def from_json(cls, d: dict) -> "PackLayer":
        return cls(
            module=d["module"],
            index=d["index"],
            tensors=[TensorLayout(t["name"], t["dtype"], tuple(t["shape"]),
                                  t["offset"], t["nbytes"]) for t in d["tensors"]],
            quantization=d["quantization"],
            records=[None if r is None else Record(((0, r[0], r[1]),), r[2],
                                                   r[3] if len(r) > 3 else None)
                     for r in d["records"]],
        )


def bound_crc(identity: int, expert: int, crc: int) -> int:
    """A record's CRC32 bound to its identity: its layer's (PackLayer.identity) and its
    expert id. A record moved to another expert, layer or tensor layout with its checksum
    no longer matches."""
    return zlib.crc32(struct.pack("<QQ", expert, crc), identity)


def aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT




def few(names: List[str]) -> str:
    """The first two of `names`, and how many more (for a message)."""
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")
