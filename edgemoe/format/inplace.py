"""Read experts straight out of an mlx-lm quantized checkpoint, with no repack.

mlx-lm stores each projection of a layer's experts as one stacked tensor
(`...switch_mlp.gate_proj.weight` of shape (experts, ...)), so expert e of a tensor is
one contiguous slice. An expert is then several reads (one per tensor, up to nine),
found from the safetensors headers alone. For users who cannot afford the disk space
of a second copy; the repacked pack reads each expert in one. Its checksums come from
the index `edgemoe.verify` writes beside it (edgemoe.format.checksums), when there is one.

Which modules hold the routed experts, and how many a token is routed to, is what
mlx-lm's model for the config says: the opener is handed a `FindExperts` that asks it
(edgemoe.mlx_backend.families.find_experts; through the load plan, the backend's). Here
are only the names and shapes of the checkpoint's tensors.
"""

from collections import defaultdict
from pathlib import Path

from .checksums import load_index, with_index
from .families import FindExperts, check_supported, layer_index
from .pack import Pack, PackError, PackLayer, read_json
from .records import Record, TensorLayout
from .resident import expert_of, read_safetensors_header

_DTYPES = {"U32": "uint32", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
           "U8": "uint8", "I32": "int32"}


def safetensors_header(path: Path):
    """(tensor name -> header entry, offset of the data section) of one file, checked
    (pack.read_safetensors_header: a damaged header is one line)."""
    return read_safetensors_header(Path(path))


def open_mlx_lm(path, find_experts: FindExperts, verify: bool = True) -> Pack:
    """A Pack whose records point into an mlx-lm quantized checkpoint's shards, at the
    routed experts `find_experts` names for its config; with `verify`, carrying the
    checksums of its index, if it has one."""
    path = Path(path)
    config = read_json(path / "config.json")
    check_supported(config, path / "config.json")
    experts, k = find_experts(config, path / "config.json")
    files = sorted(path.glob("model*.safetensors"))
    tensors = defaultdict(dict)  # module path -> tensor name -> (file, offset, entry)
    for i, f in enumerate(files):
        header, data_start = safetensors_header(f)
        for name, entry in header.items():
            found = expert_of(name, experts)
            if found is not None:
                tensors[found[0]][found[1]] = (i, data_start, entry)
    missing = [m for m in experts if m not in tensors]
    if missing and "quantization" not in config:  # a Hugging Face layout: one tensor per expert
        raise PackError(
            f"{path}: neither an edgemoe pack (no manifest.json) nor an mlx-lm checkpoint "
            f"(its experts are not stacked as mlx-lm saves them); convert it with "
            f"`python -m edgemoe.convert --hf-path {path} --mlx-path DST`"
        )
    if missing:
        raise PackError(f"{path}: the shards hold no tensors of the routed experts "
                        f"{missing[0]} (and {len(missing) - 1} more)" if len(missing) > 1 else
                        f"{path}: the shards hold no tensors of the routed experts {missing[0]}")
    layers = [_layer(module, tensors[module], config, files) for module in experts]
    size = sum(f.stat().st_size for f in files)
    pack = Pack(path, config["model_type"], k, layers, size, files=files, in_place=True)
    index = load_index(pack) if verify else None
    return with_index(pack, index) if index is not None else pack


def _expert_count(config: dict):
    from .shape import FIELDS

    text = {**config, **(config.get("text_config") or {})}
    return next((text[n] for n in FIELDS["experts"][0] if isinstance(text.get(n), int)), None)


def _layer(module: str, found: dict, config: dict, files) -> PackLayer:
    layout, offset = [], 0
    expected = _expert_count(config)
    for name in sorted(found):
        file_index, _, entry = found[name]
        where = f"{files[file_index]}: tensor {module}.{name}"
        if entry["dtype"] not in _DTYPES:
            raise PackError(f"{where}: expert dtype {entry['dtype']}, expected one of "
                            f"{', '.join(_DTYPES)}")
        if not entry["shape"] or 0 in entry["shape"]:  # (experts,): a scalar each (nvfp4)
            raise PackError(f"{where}: shape {entry['shape']}, expected (experts, ...) with "
                            f"no empty dimension")
        num_experts, *shape = entry["shape"]
        if expected is not None and num_experts != expected:
            raise PackError(f"{where}: {num_experts} experts, config.json has {expected}; "
                            f"damaged or another model's")
        expected = num_experts  # (without a count in the config: the layer's first tensor)
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
        q = config.get("quantization", {})
        q = q.get(f"{module}.{projection}", q)  # mlx-lm's per-layer entries (mixed recipes)
        names = {t.name for t in layout}
        quantization[projection] = (
            # a per-layer entry without a mode is affine, as mlx-lm's loader reads it
            {"group_size": q["group_size"], "bits": q["bits"], "mode": q.get("mode", "affine"),
             "global_scale": f"{projection}.global_scale" in names}
            if f"{projection}.scales" in names else None
        )
    return PackLayer(module, layer_index(module), layout, quantization, records)
