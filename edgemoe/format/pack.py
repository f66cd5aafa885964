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

Here: the pack's files and opening it, every check above made at open. Beside it, by job:
its records (edgemoe.format.records), the resident safetensors files' headers and
checksums (.resident), the layout against config.json (.config_match), and writing a
pack (.writer).
"""

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .config_match import CONFIG, check_against_config, config_fields
from .records import (ALIGNMENT, ITEMSIZE, PackError, PackLayer, bound_crc, count, few,
                      read_json)
from .resident import resident_checksums, safetensors_header

FORMAT = "edgemoe.pack"
VERSION = 1
MANIFEST = "manifest.json"
EXPERTS_FILE = "experts.bin"
RESIDENT_FILE = "model.safetensors"


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
        count(pack.top_k, "top_k", str(manifest_path))
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
        count(pack.experts_file_size, "experts_file_size", str(manifest_path))
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
                shape = [count(n, "each shape entry", where) for n in t.shape]
                if 0 in shape:  # ([]: a scalar, as nvfp4's global scale)
                    raise PackError(f"{where}: shape {list(t.shape)}: an expert tensor holds "
                                    f"at least one value")
                count(t.offset, "offset", where)
                count(t.nbytes, "nbytes", where)
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
                count(r.bound, "bound checksum", f"{manifest_path}: layer {layer.index} "
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
            raise PackError(f"{config_path}: the model has MoE modules {few(modules)}, the "
                            f"pack holds {few(mine)}; restore config.json or convert the "
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
                count(record.offset, "record offset", where)
                count(record.length, "record length", where)
                if record.crc32 is not None:
                    count(record.crc32, "record checksum", where)
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
