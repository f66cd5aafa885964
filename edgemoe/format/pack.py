"""The edgemoe pack: resident weights, one aligned record per routed expert, a manifest.

    model.safetensors   everything but the routed experts, as mlx-lm names it (over 5 GB:
                        model-0000i-of-0000N.safetensors and their index, as mlx-lm shards)
    experts.bin         one contiguous record per (layer, expert), 16 KiB aligned
    manifest.json       format version, per-layer record layout, offsets, CRC32s
    config.json, tokenizer files

A record holds all of one expert's tensors (weights, scales, biases of every
projection) back to back, so one `preadv` scatters it straight into the slot arrays.

What the manifest checks, beside each record's CRC32 of its bytes (checked as it is read):
each record's CRC is bound to its identity (`bound_crc`: its layer's module, index, tensor
names, dtypes, shapes and quantization, and its expert id), so records, layer lists or
tensor names swapped with their checksums fail at open; `files` lists every file convert
wrote, with a SHA-256 of each small one that changes the output (tokenizer, generation
config, chat template), so `convert --overwrite` removes only those and a changed
vocabulary fails at open; and the layout must agree with config.json (expert count, top-k,
quantization, dtypes, widths). Packs written before these fields still open: unbound, and
`edgemoe.verify` says so.
"""

import hashlib
import json
import os
import struct
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import numpy as np

FORMAT = "edgemoe.pack"
VERSION = 1
ALIGNMENT = 16 * 1024
MANIFEST = "manifest.json"
EXPERTS_FILE = "experts.bin"
RESIDENT_FILE = "model.safetensors"


class PackError(ValueError):
    """A pack is missing, truncated, corrupt, or of another format version."""


MAX_MANIFEST_BYTES = 256 * 2**20
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit
ITEMSIZE = {"bool": 1, "uint8": 1, "int8": 1, "uint16": 2, "int16": 2, "float16": 2,
            "bfloat16": 2, "uint32": 4, "int32": 4, "float32": 4, "uint64": 8, "int64": 8,
            "float64": 8, "complex64": 8}
CONFIG = "config.json"
# what decides routing and shapes: compared with what the manifest holds at load
ROUTING_FIELDS = ("model_type", "num_experts_per_tok", "num_experts", "num_local_experts",
                  "n_routed_experts", "moe_intermediate_size", "intermediate_size",
                  "hidden_size", "num_hidden_layers", "first_k_dense_replace",
                  "decoder_sparse_step", "mlp_only_layers", "moe_layer_freq",
                  "num_experts_per_token", "experts_per_token", "n_group", "topk_group",
                  "norm_topk_prob", "routed_scaling_factor", "scoring_func", "topk_method",
                  "quantization")


def _count(value, what: str, where: str) -> int:
    """A manifest integer: an int (not a bool), not negative."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise PackError(f"{where}: {what} must be a non-negative integer, found "
                        f"{json.dumps(value)[:40]}")
    return value


def config_fields(config: dict) -> dict:
    """The config.json fields that decide routing and shapes (of the text model)."""
    text = {**config, **(config.get("text_config") or {})}
    return {k: text[k] for k in ROUTING_FIELDS if k in text}


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


@dataclass
class Pack:
    path: Path
    model_type: str
    top_k: int
    layers: List[PackLayer]
    experts_file_size: int
    files: List[Path] = field(default_factory=list)  # what records' segments index
    in_place: bool = False  # an mlx-lm checkpoint read as it is, not a repacked pack
    resident_crc32: Optional[Dict[str, int]] = None  # tensor of model.safetensors -> CRC32
    shard: Optional[dict] = None  # one host's share of the experts (edgemoe.distributed)
    config: Optional[dict] = None  # config.json's sha256 and routing fields, as written
    bound: bool = False  # every record's checksum bound to its identity (bound_crc)
    written: Optional[Dict[str, Optional[str]]] = None  # manifest "files": convert's, sha256

    def __post_init__(self):
        self.files = self.files or [self.path / EXPERTS_FILE]

    @property
    def experts_path(self) -> Path:
        return self.files[0] if self.in_place else self.path / EXPERTS_FILE

    @property
    def expert_bytes(self) -> int:
        """All routed-expert bytes this pack holds (payload, without alignment padding)."""
        return sum(l.expert_bytes * l.num_owned for l in self.layers)

    @property
    def resident_files(self) -> List[Path]:
        """model.safetensors, or the shards of a large model's resident weights (in place:
        the checkpoint's shards, which hold the experts too)."""
        return sorted(self.path.glob("model*.safetensors"))

    @property
    def resident_bytes(self) -> int:
        size = sum(f.stat().st_size for f in self.resident_files)
        every_expert = sum((l.expert_bytes - l.delta_bytes) * l.num_experts
                           for l in self.layers)
        return size - (every_expert if self.in_place else 0)

    @classmethod
    def open(cls, path, verify: bool = True) -> "Pack":
        """Read and check a pack's manifest; the experts file must be whole. With `verify`
        every expert record and every resident tensor must have a checksum (the records'
        are checked as they are read, the resident ones by `verify_resident`)."""
        path = Path(path)
        manifest_path = path / MANIFEST
        if not manifest_path.exists() and (path / EXPERTS_FILE).exists():
            raise PackError(f"{path}: an edgemoe pack without its {MANIFEST} (damaged or "
                            f"unfinished); convert the checkpoint again")
        if not manifest_path.exists():
            raise PackError(
                f"{path}: not an edgemoe pack (no {MANIFEST}); convert it first with "
                f"`python -m edgemoe.convert --hf-path {path} --mlx-path DST`"
            )
        m = read_json(manifest_path)
        if m.get("format") != FORMAT:
            raise PackError(f"{manifest_path}: format is {m.get('format')!r}, expected {FORMAT!r}")
        if m.get("version") != VERSION:
            raise PackError(
                f"{manifest_path}: format version {m.get('version')}, this edgemoe reads "
                f"version {VERSION}; convert the checkpoint again"
            )
        try:
            pack = cls(
                path=path,
                model_type=m["model_type"],
                top_k=m["top_k"],
                layers=[PackLayer.from_json(l) for l in m["layers"]],
                experts_file_size=m["experts_file_size"],
                resident_crc32=(m.get("resident") or {}).get("crc32"),
                shard=m.get("shard"),
            )
        except KeyError as e:
            raise PackError(f"{manifest_path}: missing field {e}; convert the checkpoint "
                            f"again") from None
        except PackError:
            raise
        except (TypeError, ValueError, AttributeError, IndexError) as e:
            raise PackError(f"{manifest_path}: malformed ({e}); convert the checkpoint "
                            f"again") from None
        _count(pack.top_k, "top_k", str(manifest_path))
        crcs = pack.resident_crc32
        if crcs is not None and not (isinstance(crcs, dict) and all(
                isinstance(v, int) and not isinstance(v, bool) for v in crcs.values())):
            raise PackError(f"{manifest_path}: malformed 'resident' (expected tensor: CRC32)")
        for layer in pack.layers:
            if not (isinstance(layer.module, str) and isinstance(layer.index, int)
                    and isinstance(layer.quantization, dict) and all(
                        q is None or isinstance(q, dict) for q in layer.quantization.values())
                    and all(isinstance(t.name, str) and "." in t.name for t in layer.tensors)):
                raise PackError(f"{manifest_path}: layer {json.dumps(layer.index)[:20]}: "
                                f"malformed (module, index, quantization or tensor names)")
        _count(pack.experts_file_size, "experts_file_size", str(manifest_path))
        pack._check_layouts(manifest_path)
        pack._check_records(manifest_path)
        pack._check_experts_file()
        pack.config = pack._check_config(m.get("config"), manifest_path)
        pack.bound = pack._check_bound(manifest_path)
        pack.written = pack._check_files(m.get("files"), manifest_path)
        if not pack.in_place and (path / CONFIG).exists():
            check_against_config(pack, read_json(path / CONFIG), manifest_path)
        for f in pack.resident_files:  # a damaged header is named here, not by mx.load
            safetensors_header(f)
        if verify:
            pack._check_checksums_present(manifest_path)
        return pack

    def _check_layouts(self, manifest_path: Path):
        """Each layer's tensors: known dtypes, shapes whose bytes are their byte counts
        (slots are sized from the shapes, budgets from the counts), back to back without
        overlap."""
        for layer in self.layers:
            end = 0
            for t in sorted(layer.tensors, key=lambda t: t.offset):
                where = f"{manifest_path}: layer {layer.index} tensor {t.name}"
                if t.dtype not in ITEMSIZE:
                    raise PackError(f"{where}: unknown dtype {t.dtype!r}")
                shape = [_count(n, "each shape entry", where) for n in t.shape]
                if 0 in shape:  # ([]: a scalar, as nvfp4's global scale)
                    raise PackError(f"{where}: shape {list(t.shape)}: an expert tensor holds "
                                    f"at least one value")
                _count(t.offset, "offset", where)
                _count(t.nbytes, "nbytes", where)
                if int(np.prod(shape, dtype=object)) * ITEMSIZE[t.dtype] != t.nbytes:
                    raise PackError(f"{where}: shape {list(t.shape)} of {t.dtype} takes "
                                    f"{int(np.prod(shape, dtype=object)) * ITEMSIZE[t.dtype]}"
                                    f" bytes, the manifest says {t.nbytes}")
                if t.offset < end:
                    raise PackError(f"{where}: overlaps the tensor before it (offset "
                                    f"{t.offset}, the one before ends at {end})")
                end = t.offset + t.nbytes
            if end != layer.expert_bytes:
                raise PackError(f"{manifest_path}: layer {layer.index}: its tensors end at "
                                f"{end}, expected back to back in {layer.expert_bytes} bytes")

    def _check_config(self, recorded, manifest_path: Path) -> Optional[dict]:
        """config.json as convert wrote it: its SHA-256 the manifest's, and the fields
        that decide routing and shapes unchanged (a pack written before the manifest
        held them is compared at load with what the model's code routes: see
        check_routing)."""
        path = self.path / CONFIG
        if recorded is None:
            return None
        if not isinstance(recorded, dict) or not isinstance(recorded.get("sha256"), str):
            raise PackError(f"{manifest_path}: malformed 'config' (expected its sha256 and "
                            f"fields)")
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise PackError(f"{path}: missing (the manifest lists its checksum)") from None
        found = hashlib.sha256(data).hexdigest()
        if found != recorded["sha256"]:
            now, was = config_fields(read_json(path)), recorded.get("fields") or {}
            changed = [f"{k} (expected {json.dumps(was.get(k))}, found {json.dumps(now.get(k))})"
                       for k in sorted(set(now) | set(was)) if now.get(k) != was.get(k)]
            detail = "; changed: " + ", ".join(changed[:3]) if changed else ""
            raise PackError(f"{path}: checksum mismatch (expected {recorded['sha256'][:16]}..., "
                            f"found {found[:16]}...){detail}; it was changed after convert: "
                            f"restore it or convert the checkpoint again")
        return recorded

    def _check_bound(self, manifest_path: Path) -> bool:
        """Every record's bound checksum against its identity; whether records are bound
        (a pack written before they were: none is)."""
        records = [(layer, e, r) for layer in self.layers for e, r in enumerate(layer.records)
                   if r is not None and r.crc32 is not None]
        bound = [r.bound is not None for _, _, r in records]
        if not any(bound):
            return False
        if not all(bound):
            layer, e, _ = records[bound.index(False)]
            raise PackError(f"{manifest_path}: layer {layer.index} expert {e}: its record has "
                            f"no bound checksum where the others have one; edited after "
                            f"convert: convert the checkpoint again")
        for layer in self.layers:
            identity = layer.identity
            for e, r in enumerate(layer.records):
                if r is None or r.crc32 is None:
                    continue
                _count(r.bound, "bound checksum", f"{manifest_path}: layer {layer.index} "
                                                  f"expert {e}")
                if bound_crc(identity, e, r.crc32) != r.bound:
                    raise PackError(
                        f"{manifest_path}: layer {layer.index} expert {e}: its checksum is not "
                        f"bound to this expert of this layer and tensor layout (records, layer "
                        f"lists or tensor names swapped or relabelled after convert); convert "
                        f"the checkpoint again")
        return True

    def _check_files(self, files, manifest_path: Path) -> Optional[Dict[str, Optional[str]]]:
        """The files convert wrote (manifest "files"): each there, and each small one's
        SHA-256 (tokenizer, generation config, chat template: they change the output)."""
        if files is None:
            return None
        if not isinstance(files, dict) or not all(
                isinstance(n, str) and "/" not in n and n not in ("", ".", "..")
                and (v is None or isinstance(v, str)) for n, v in files.items()):
            raise PackError(f"{manifest_path}: malformed 'files' (expected file name: sha256 "
                            f"or null)")
        for name, sha in sorted(files.items()):
            if sha is None:
                continue
            try:
                found = hashlib.sha256((self.path / name).read_bytes()).hexdigest()
            except FileNotFoundError:
                raise PackError(f"{self.path / name}: missing (the manifest lists its "
                                f"checksum); restore it or convert the checkpoint "
                                f"again") from None
            if found != sha:
                raise PackError(f"{self.path / name}: checksum mismatch (expected {sha[:16]}..., "
                                f"found {found[:16]}...); it was changed after convert and "
                                f"changes the output: restore it or convert the checkpoint "
                                f"again")
        return files

    def check_routing(self, modules: List[str], top_k: int, config_path):
        """What the model built from config.json routes (its MoE modules, experts per
        token) against what the pack was written for: a config.json changed after
        convert must not run with other routing."""
        if self.in_place:
            return
        if top_k != self.top_k:
            raise PackError(f"{config_path}: routes {top_k} experts per token, the pack was "
                            f"written for {self.top_k} (manifest top_k); restore config.json "
                            f"or convert the checkpoint again")
        mine = [l.module for l in self.layers]
        if sorted(modules) != sorted(mine):
            raise PackError(f"{config_path}: the model has MoE modules {_few(modules)}, the "
                            f"pack holds {_few(mine)}; restore config.json or convert the "
                            f"checkpoint again")

    def _check_records(self, manifest_path: Path):
        """Every record where convert puts one: aligned, of its layer's size, inside the
        experts file, overlapping no other (a damaged manifest is named here, not as a
        failed read or another expert's bytes later)."""
        spans = []
        for layer in self.layers:
            for e, record in enumerate(layer.records):
                if record is None:  # another host's expert
                    continue
                where = f"{manifest_path}: layer {layer.index} expert {e}"
                _count(record.offset, "record offset", where)
                _count(record.length, "record length", where)
                if record.crc32 is not None:
                    _count(record.crc32, "record checksum", where)
                spans.append((record.offset, record.offset + record.length, layer.index, e))
                if record.offset % ALIGNMENT:
                    raise PackError(f"{where}: record offset {record.offset} is not "
                                    f"{ALIGNMENT}-byte aligned")
                if record.length != layer.expert_bytes:
                    raise PackError(f"{where}: record of {record.length} bytes, its tensors "
                                    f"take {layer.expert_bytes}")
                if record.offset + record.length > self.experts_file_size:
                    raise PackError(f"{where}: record ends at {record.offset + record.length}, "
                                    f"past the experts file's {self.experts_file_size} bytes")
        spans.sort()
        for (_, end, li, ei), (start, _, lj, ej) in zip(spans, spans[1:]):
            if start < end:
                raise PackError(f"{manifest_path}: layer {lj} expert {ej}: its record "
                                f"(offset {start}) overlaps layer {li} expert {ei}'s (which "
                                f"ends at {end})")

    def _check_checksums_present(self, manifest_path: Path):
        fix = "convert the checkpoint again, or pass --no-verify to read it unchecked"
        for layer in self.layers:
            for e, record in enumerate(layer.records):
                if record is not None and record.crc32 is None:
                    raise PackError(f"{manifest_path}: layer {layer.index} expert {e} has no "
                                    f"checksum; {fix}")
        if not self.resident_crc32:
            raise PackError(f"{manifest_path}: no checksums for {RESIDENT_FILE}; {fix}")

    def verify_resident(self, uncached: bool = False):
        """Check every resident tensor against its CRC32: a PackError names the first that
        differs. Reads every resident tensor (in place: those of every shard, beside the
        experts); `uncached` drops the pages read as it goes (for --io direct)."""
        files = self.resident_files
        found = {}  # tensor -> (crc, the file it lies in)
        for f in files:
            names = set(self.resident_crc32) if self.in_place else None
            found.update({n: (crc, f) for n, crc in resident_checksums(f, names=names, uncached=uncached).items()})
        for name, crc in sorted(self.resident_crc32.items()):
            if name not in found:
                raise PackError(f"{files[0]}: tensor {name}: missing (its checksum is listed)")
            got, where = found[name]
            if got != crc:
                raise PackError(f"{where}: tensor {name}: checksum mismatch (expected "
                                f"{crc:08x}, found {got:08x})")
        extra = sorted(set(found) - set(self.resident_crc32))
        if extra:
            raise PackError(f"{files[0]}: tensors the manifest does not list: "
                            f"{', '.join(extra[:5])}")

    def _check_experts_file(self):
        if not self.experts_path.exists():
            raise PackError(f"{self.experts_path}: missing")
        found = self.experts_path.stat().st_size
        if found != self.experts_file_size:
            raise PackError(
                f"{self.experts_path}: truncated or overwritten "
                f"(expected {self.experts_file_size} bytes, found {found})"
            )

    @property
    def fingerprint(self) -> str:
        """A short hash of the routed experts' layout and checksums (for a checkpoint read
        in place, of where its tensors lie): routing traces name the model they came from."""
        layout = [self.model_type, self.top_k, self.experts_file_size,
                  [[l.index, l.to_json()["tensors"], [None if r is None else
                                                     list(r.segments) + [r.crc32]
                                                     for r in l.records]]
                   for l in self.layers]]
        return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:16]

    def layer_named(self, module: str) -> PackLayer:
        for layer in self.layers:
            if layer.module == module:
                return layer
        raise KeyError(module)


def bound_crc(identity: int, expert: int, crc: int) -> int:
    """A record's CRC32 bound to its identity: its layer's (PackLayer.identity) and its
    expert id. A record moved to another expert, layer or tensor layout with its checksum
    no longer matches."""
    return zlib.crc32(struct.pack("<QQ", expert, crc), identity)


def record_layout(tensors: Dict[str, np.ndarray], dtypes: Dict[str, str]) -> List[TensorLayout]:
    """Lay one expert's tensors (given stacked over experts) back to back, by name."""
    layout, offset = [], 0
    for name in sorted(tensors):
        per_expert = tensors[name][0]
        layout.append(TensorLayout(name, dtypes[name], tuple(per_expert.shape),
                                   offset, per_expert.nbytes))
        offset += per_expert.nbytes
    return layout


def aligned(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


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
                _count(n, "an offset or shape entry", f"{path}: tensor {name}")
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


FLOAT_DTYPES = ("float16", "bfloat16", "float32")


def check_against_config(pack: "Pack", config: dict, manifest_path: Path):
    """The manifest's layout against config.json: each layer's expert count, top-k, the
    quantization of each projection (bits, group size, mode), dtypes a quantized or
    float weight can have, scales that fit their weight, and widths the config declares."""
    from .shape import FIELDS

    text = {**config, **(config.get("text_config") or {})}
    cfg = pack.path / CONFIG

    def declared(key):
        name = next((n for n in FIELDS[key][0] if isinstance(text.get(n), int)), None)
        return (name, text[name]) if name else (None, None)

    name, top_k = declared("top_k")
    if top_k is not None and pack.top_k != top_k:
        raise PackError(f"{cfg}: routes {top_k} experts per token, the pack was written for "
                        f"{pack.top_k} (manifest top_k; config.json's {name}); restore "
                        f"config.json or convert the checkpoint again")
    name, experts = declared("experts")
    widths = {v for k, v in text.items() if isinstance(v, int) and not isinstance(v, bool)
              and (k.endswith(("_size", "_dim")) or k in ("d_model", "n_embd"))}
    for layer in pack.layers:
        where = f"{manifest_path}: layer {layer.index}"
        if experts is not None and layer.num_experts != experts:
            raise PackError(f"{where}: {layer.num_experts} expert records, {cfg} has "
                            f"{experts} experts ({name}); convert the checkpoint again")
        parts = {}
        for t in layer.tensors:
            parts.setdefault(t.projection, {})[t.kind] = t
        for projection, kinds in parts.items():
            q = layer.quantization.get(projection)
            _check_quantization(q, text.get("quantization"), layer.module, projection,
                                f"{where} {projection}", cfg)
            _check_projection(kinds, q, widths, f"{where} {projection}", cfg)


def _check_quantization(q, recipe, module: str, projection: str, where: str, cfg: Path):
    """A projection's quantization against config.json's recipe (mlx-lm's: a default and
    per-module entries)."""
    if q is None:
        return
    if not isinstance(recipe, dict):
        raise PackError(f"{where}: quantized ({q.get('bits')} bits), {cfg} is not; convert "
                        f"the checkpoint again")
    want = recipe.get(f"{module}.{projection}", recipe)
    for key in ("bits", "group_size"):
        if not isinstance(q.get(key), int) or isinstance(q.get(key), bool) or q[key] <= 0:
            raise PackError(f"{where}: quantization {key} {json.dumps(q.get(key))[:20]}, "
                            f"expected a positive whole number")
        if not isinstance(want, dict) or q[key] != want.get(key):
            found = want.get(key) if isinstance(want, dict) else want
            raise PackError(f"{where}: quantization {key} {q[key]}, {cfg} says {found}; "
                            f"convert the checkpoint again")
    if q.get("mode", "affine") != want.get("mode", "affine"):
        raise PackError(f"{where}: quantization mode {q.get('mode')!r}, {cfg} says "
                        f"{want.get('mode', 'affine')!r}; convert the checkpoint again")


def _check_projection(kinds: dict, q, widths: set, where: str, cfg: Path):
    """A projection's dtypes and shapes: a quantized weight is uint32 with scales (and
    biases) of its rows and groups, a float one a float; its widths the config's."""
    weight = kinds.get("weight")
    if weight is None or len(weight.shape) < 2:
        return
    out_features = weight.shape[0]
    if q is None:
        if weight.dtype not in FLOAT_DTYPES:
            raise PackError(f"{where}.weight: dtype {weight.dtype}, expected a float "
                            f"({', '.join(FLOAT_DTYPES)}) for an unquantized weight")
        in_features = weight.shape[-1]
    else:
        if weight.dtype != "uint32":
            raise PackError(f"{where}.weight: dtype {weight.dtype}, expected uint32 for a "
                            f"{q['bits']}-bit quantized weight")
        in_features = weight.shape[-1] * 32 // q["bits"]
        scale_dtypes = FLOAT_DTYPES if q.get("mode", "affine") == "affine" else \
            FLOAT_DTYPES + ("uint8",)
        expected = (out_features, in_features // q["group_size"])
        for kind in ("scales", "biases"):
            t = kinds.get(kind)
            if t is None:
                if kind == "scales":
                    raise PackError(f"{where}: quantized without scales")
                continue
            if t.dtype not in scale_dtypes:
                raise PackError(f"{where}.{kind}: dtype {t.dtype}, expected one of "
                                f"{', '.join(scale_dtypes)}")
            if tuple(t.shape) != expected:
                raise PackError(f"{where}.{kind}: shape {list(t.shape)}, expected "
                                f"{list(expected)} for a {q['bits']}-bit weight of shape "
                                f"{list(weight.shape)} in groups of {q['group_size']}")
    if widths and not {out_features, in_features} & widths:
        raise PackError(f"{where}.weight: maps {in_features} to {out_features} features, "
                        f"neither a width {cfg} declares (hidden_size "
                        f"{next(iter(sorted(widths)), '?')}...); convert the checkpoint again")


def _few(names: List[str]) -> str:
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


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
