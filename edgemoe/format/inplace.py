"""Read experts straight out of an mlx-lm quantized checkpoint, with no repack.

mlx-lm stores each projection of a layer's experts as one stacked tensor
(`...switch_mlp.gate_proj.weight` of shape (experts, ...)), so expert e of a tensor is
one contiguous slice. An expert is then several reads (one per tensor, up to nine),
found from the safetensors headers alone. For users who cannot afford the disk space
of a second copy; the repacked pack reads each expert in one. Its checksums come from
the index `edgemoe.verify` writes beside it (edgemoe.format.checksums), when there is one.
"""

import json
import struct
from collections import defaultdict
from pathlib import Path

from .checksums import load_index, with_index
from .families import check_supported, layer_index, top_k
from .pack import Pack, PackError, PackLayer, Record, TensorLayout

EXPERTS_MARKER = ".switch_mlp."  # in the names of routed-expert tensors
_DTYPES = {"U32": "uint32", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "U8": "uint8", "I32": "int32"}


def safetensors_header(path: Path):
    """(tensor name -> header entry, offset of the data section) of one file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise PackError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header, 8 + n


def resident_tensor_names(path: Path) -> set:
    """The tensors of a shard that are not routed experts."""
    return {name for name in safetensors_header(path)[0] if EXPERTS_MARKER not in name}


def open_mlx_lm(path, verify: bool = True) -> Pack:
    """A Pack whose records point into an mlx-lm quantized checkpoint's shards; with
    `verify`, carrying the checksums of its index, if it has one."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    check_supported(config, path / "config.json")
    if "quantization" not in config:
        raise PackError(
            f"{path}: neither an edgemoe pack (no manifest.json) nor an mlx-lm quantized "
            f"checkpoint; convert it with `python -m edgemoe.convert --hf-path {path} "
            f"--mlx-path DST`"
        )
    files = sorted(path.glob("model*.safetensors"))
    tensors = defaultdict(dict)  # module path -> tensor name -> (file, offset, entry)
    for i, f in enumerate(files):
        header, data_start = safetensors_header(f)
        for name, entry in header.items():
            module, sep, tensor = name.partition(EXPERTS_MARKER)
            if sep:
                tensors[module + ".switch_mlp"][tensor] = (i, data_start, entry)
    if not tensors:
        raise PackError(f"{path}: no routed experts (switch_mlp tensors) found")
    layers = [_layer(module, found, config) for module, found in
              sorted(tensors.items(), key=lambda kv: layer_index(kv[0]))]
    size = sum(f.stat().st_size for f in files)
    pack = Pack(path, config["model_type"], top_k(config), layers, size, files=files,
                in_place=True)
    index = load_index(pack) if verify else None
    return with_index(pack, index) if index is not None else pack


def _layer(module: str, found: dict, config: dict) -> PackLayer:
    layout, offset = [], 0
    for name in sorted(found):
        _, _, entry = found[name]
        num_experts, *shape = entry["shape"]
        start, end = entry["data_offsets"]
        nbytes = (end - start) // num_experts
        layout.append(TensorLayout(name, _DTYPES[entry["dtype"]], tuple(shape), offset, nbytes))
        offset += nbytes
    records = []
    for e in range(num_experts):
        segments = []
        for t in layout:
            file_index, data_start, entry = found[t.name]
            segments.append((file_index, data_start + entry["data_offsets"][0] + e * t.nbytes,
                             t.nbytes))
        records.append(Record(tuple(segments)))
    quantization = {}
    for projection in sorted({t.projection for t in layout}):
        q = config["quantization"]
        q = q.get(f"{module}.{projection}", q)
        has_scales = any(t.name == f"{projection}.scales" for t in layout)
        quantization[projection] = (
            {"group_size": q["group_size"], "bits": q["bits"], "mode": q.get("mode", "affine")}
            if has_scales else None
        )
    return PackLayer(module, layer_index(module), layout, quantization, records)
