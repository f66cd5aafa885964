"""An edgemoe pack written back as the mlx-lm checkpoint it was converted from: the resident
tensors as they are, each layer's expert records stacked into mlx-lm's SwitchGLU tensors.
The exactness tests load it with mlx-lm itself (the reference) and with edgemoe in place."""

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np

from edgemoe.format.pack import Pack

DTYPES = {"uint32": np.uint32, "float32": np.float32, "float16": np.float16,
          "bfloat16": np.uint16, "uint8": np.uint8, "int8": np.int8}


def unpack(pack_path: Path, out: Path) -> Path:
    pack = Pack.open(pack_path)
    out.mkdir(parents=True, exist_ok=True)
    for f in pack_path.iterdir():  # config, tokenizer, chat template
        if f.is_file() and f.suffix in (".json", ".jinja") and f.name != "manifest.json":
            shutil.copy(f, out / f.name)
    weights = dict(mx.load(str(pack_path / "model.safetensors")))
    raw = np.memmap(pack.experts_path, dtype=np.uint8, mode="r")
    for layer in pack.layers:
        for t in layer.tensors:
            rows = [raw[r.offset + t.offset: r.offset + t.offset + t.nbytes].view(DTYPES[t.dtype])
                    .reshape(t.shape) for r in layer.records]
            stacked = mx.array(np.stack(rows))
            if t.dtype == "bfloat16":
                stacked = stacked.view(mx.bfloat16)
            weights[f"{layer.module}.{t.name}"] = stacked
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    return out
