"""The routed experts' LoRA deltas as records, streamed with their experts.

A LoRA in mlx-lm's format may adapt the routed experts: its keys
`model.layers.N.mlp.switch_mlp.gate_proj.lora_a` (experts x rank x in) and `.lora_b`
(experts x out x rank) hold every expert's delta. Held resident, that is every expert's
delta in memory, which is what edgemoe exists to avoid. So the deltas are laid out as the
experts are, one aligned record per (layer, expert), and a fill reads an expert's record
and its delta's in the same request into the same slot (a record of two segments:
edgemoe.streaming.reads); the pool adds the delta as mlx-lm's LoRASwitchLinear does.

    ADAPTER/expert_deltas.bin    one record per (layer, expert): each adapted projection's
                                 lora_a then lora_b, in projection order
    ADAPTER/expert_deltas.json   per layer the record layout and offsets; the adapter
                                 file and the pack they were written for

`expert_deltas(adapter, source)` writes them on first use, and again when the adapter's
content or the pack changed (a load reads the adapter file once to check). Where the
adapter's folder is read-only (a system-wide install, a shared model folder), they go to
the user's cache instead: $XDG_CACHE_HOME (or ~/.cache)/edgemoe/expert_deltas/, in a
folder named after the adapter's content and the pack. Each record's CRC32 is chained onto
its expert's (the pack's CRC32 of the expert record), so a fill's bytes check as one.
"""

import json
import os
import secrets
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from .adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LEAVES, lora_key, owner
from .inplace import _DTYPES, safetensors_header
from .pack import Pack, PackError, PackLayer, read_json
from .records import Record, TensorLayout
from .writer import ExpertsWriter

FORMAT = "edgemoe.expert_deltas"
VERSION = 1
RECORDS = "expert_deltas.bin"
MANIFEST = "expert_deltas.json"


@dataclass
class DeltaRecords:
    """An adapter's delta records: per pack layer module, the layout of one record, its
    records by expert, and the LoRA scale."""

    path: Path  # the records file
    scale: float
    layers: Dict[str, PackLayer]


def delta_tensors(adapter: Path, source: Pack) -> Dict[str, Dict[str, dict]]:
    """The adapter's routed-expert tensors: layer module -> name within it
    (`gate_proj.lora_a`) -> safetensors header entry (with `start`: the data's offset)."""
    header, data_start = safetensors_header(adapter / ADAPTER_WEIGHTS)
    found: Dict[str, Dict[str, dict]] = {}
    for layer in source.layers:
        for name, entry in header.items():
            if owner(name, [layer.module]) and lora_key(name)[1]:
                found.setdefault(layer.module, {})[name[len(layer.module) + 1:]] = \
                    {**entry, "start": data_start + entry["data_offsets"][0]}
    return found


def expert_deltas(adapter, source: Pack) -> Optional[DeltaRecords]:
    """The delta records of `adapter` (a folder in mlx-lm's format) for `source`'s routed
    experts, written first if missing or stale; None when it adapts no routed expert."""
    adapter = Path(adapter)
    tensors = delta_tensors(adapter, source)
    if not tensors:
        return None
    stamp = _stamp(adapter, source)
    cache = _cache_folder(stamp)
    for folder in (adapter, cache):
        manifest = folder / MANIFEST
        try:  # a damaged one is written again, as a stale one is
            found = read_json(manifest) if manifest.exists() else {}
        except PackError:
            found = {}
        if found.get("source") == stamp:
            return _read(folder, found)
    folder = adapter if os.access(adapter, os.W_OK) else cache
    return _read(folder, _write(folder, adapter, source, tensors, stamp))


def _cache_folder(stamp: dict) -> Path:
    """Where the records go when the adapter's folder is read-only: named after what they
    are written from, so a changed adapter or pack never finds another's."""
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return root / "edgemoe" / "expert_deltas" / f"{stamp['adapter_crc32']:08x}-{stamp['pack']}"


def _stamp(adapter: Path, source: Pack, chunk: int = 16 * 2**20) -> dict:
    """What the records were written from: the adapter file's CRC32 (its content: a copy
    or a checkout keeps it, a retrained adapter changes it), and the pack."""
    crc = 0
    with open(adapter / ADAPTER_WEIGHTS, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return {"adapter_crc32": crc, "pack": source.fingerprint}


def _write(folder: Path, adapter: Path, source: Pack, tensors, stamp: dict):
    """Both files, written into `folder` under names of this process's own and renamed
    into place (the records, then the manifest that vouches for them): never
    half-written, and two processes loading the adapter for the first time at once both
    succeed (their files are the same bytes). A failed write leaves nothing behind."""
    config = read_json(adapter / ADAPTER_CONFIG)
    weights = np.memmap(adapter / ADAPTER_WEIGHTS, dtype=np.uint8, mode="r")
    mine = f".partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp, tmp_manifest = folder / (RECORDS + mine), folder / (MANIFEST + mine)
    writing = tmp
    try:
        folder.mkdir(parents=True, exist_ok=True)
        writer = ExpertsWriter(tmp)
        layers = []
        for layer in source.layers:
            if layer.module not in tensors:
                continue
            layout = _layout(layer, tensors[layer.module], adapter)
            records = []
            for e, expert in enumerate(layer.records):
                parts = [_expert_slice(weights, tensors[layer.module][t.name], e)
                         for t in layout]
                chained = expert is not None and expert.crc32 is not None
                record = writer.write(parts, expert.crc32 if chained else 0)
                records.append([record.offset, record.length,
                                record.crc32 if chained else None])
            layers.append({"module": layer.module, "records": records,
                           "tensors": [asdict(t) for t in layout]})
        writer.close()
        manifest = {"format": FORMAT, "version": VERSION, "source": stamp,
                    "scale": config["lora_parameters"]["scale"], "layers": layers}
        writing = tmp_manifest
        with open(tmp_manifest, "w") as f:
            f.write(json.dumps(manifest, indent=1))
            f.flush()
            os.fsync(f.fileno())
        writing = folder / RECORDS
        os.replace(tmp, folder / RECORDS)
        writing = folder / MANIFEST
        os.replace(tmp_manifest, folder / MANIFEST)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        tmp_manifest.unlink(missing_ok=True)
        if isinstance(e, OSError):
            why = os.strerror(e.errno) if e.errno else str(e)
            name = writing.name.split(".partial-")[0]
            raise PackError(f"{folder / name}: cannot write the routed experts' delta "
                            f"records ({why}); free space, or copy the adapter to a "
                            f"writable folder") from None
        raise
    return manifest


def _layout(layer: PackLayer, entries: Dict[str, dict], adapter: Path) -> List[TensorLayout]:
    """One record's tensors: every adapted projection's lora_a and lora_b, one expert's."""
    layout, offset = [], 0
    for name in sorted(entries, key=lambda n: (n.rsplit(".", 1)[0], n)):
        entry = entries[name]
        shape = tuple(entry["shape"])
        if shape[0] != layer.num_experts or entry["dtype"] not in _DTYPES:
            raise PackError(f"{adapter / ADAPTER_WEIGHTS}: {layer.module}.{name}: expected "
                            f"{layer.num_experts} experts' deltas, found {entry['dtype']} "
                            f"{list(shape)}")
        nbytes = (entry["data_offsets"][1] - entry["data_offsets"][0]) // shape[0]
        layout.append(TensorLayout(name, _DTYPES[entry["dtype"]], shape[1:], offset, nbytes))
        offset += nbytes
    projections = {t.projection for t in layout}
    for p in projections:
        if {t.kind for t in layout if t.projection == p} != set(LEAVES):
            raise PackError(f"{adapter / ADAPTER_WEIGHTS}: {layer.module}.{p}: lora_a and "
                            f"lora_b expected, found only one")
    return layout


def _expert_slice(weights: np.ndarray, entry: dict, expert: int) -> np.ndarray:
    """One expert's bytes of a stacked tensor (experts first, so contiguous)."""
    size = (entry["data_offsets"][1] - entry["data_offsets"][0]) // entry["shape"][0]
    start = entry["start"] + expert * size
    return weights[start:start + size]


def _read(folder: Path, manifest: dict) -> DeltaRecords:
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise PackError(f"{folder / MANIFEST}: format {manifest.get('format')!r} version "
                        f"{manifest.get('version')}, expected {FORMAT!r} version {VERSION}; "
                        f"delete it to have it written again")
    layers = {}
    for d in manifest["layers"]:
        tensors = [TensorLayout(t["name"], t["dtype"], tuple(t["shape"]), t["offset"],
                                t["nbytes"]) for t in d["tensors"]]
        records = [Record(((0, off, length),), crc) for off, length, crc in d["records"]]
        layers[d["module"]] = PackLayer(d["module"], -1, tensors, {}, records)
    return DeltaRecords(folder / RECORDS, manifest["scale"], layers)


def with_deltas(source: Pack, deltas: DeltaRecords) -> Pack:
    """`source` whose records carry the deltas: each layer's tensors are its expert's and
    then its delta's, each record two segments (the expert's, the delta's), its CRC32
    chained over both."""
    file_index = len(source.files)
    layers = []
    for layer in source.layers:
        delta = deltas.layers.get(layer.module)
        if delta is None:
            layers.append(layer)
            continue
        shift = layer.expert_bytes
        tensors = layer.tensors + [replace(t, offset=shift + t.offset) for t in delta.tensors]
        records = [None if r is None else
                   Record(r.segments + ((file_index, d.offset, d.length),), d.crc32)
                   for r, d in zip(layer.records, delta.records)]
        layers.append(replace(layer, tensors=tensors, records=records,
                              lora_scale=deltas.scale))
    return replace(source, layers=layers, files=[*source.files, deltas.path])
