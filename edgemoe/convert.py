"""Convert a Hugging Face or mlx-lm MoE checkpoint into an edgemoe pack.

    python -m edgemoe.convert --hf-path SRC --mlx-path DST [--q-mode affine|mxfp4|nvfp4|mxfp8]
        [--q-bits 4] [--q-group-size 64] [--no-quantize] [--shard i/N [--partition TRACE]]

An unquantized source is quantized exactly as `mlx_lm.convert -q` does it (mlx-lm's
own loader, dtype cast, quantization predicates, modes); an mlx-lm quantized source keeps
its quantization, whatever its modes and per-layer recipe. The pack is written to a temporary folder beside DST and renamed at the
end, so an interrupted conversion leaves nothing half-written at DST. `--shard i/N` writes
host i's pack of N (edgemoe.distributed): the resident weights whole, the routed experts
host i owns (round-robin, or balanced by a routing trace), and the partition in the manifest.
"""

import argparse
import errno
import glob
import json
import os
import secrets
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_map_with_path, tree_unflatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import MAX_FILE_SIZE_GB, quantize_model, save_config
from tqdm import tqdm

from .cli import tool, tool_parser
from .distributed import Partition, make_partition, parse_shard
from .format.source import SHARD_INDEX, model_path
from .format.destination import (OURS, DestinationLock, check_destination, is_pack,
                                 keep_theirs, remove_ours, replace_with)
from .format.families import layer_index
from .mlx_backend.families import find_experts, routed_experts
from .mlx_backend.experts import expert_modules
from .format.pack import ALIGNMENT, EXPERTS_FILE, PackError, PackLayer, RESIDENT_FILE
from .format.writer import (ExpertsWriter, record_layout, record_written_files,
                            write_manifest)

CONVERSION_DTYPES = ("float16", "bfloat16", "float32")
Q_MODES = ("affine", "mxfp4", "nvfp4", "mxfp8")


def convert(hf_path, mlx_path, q_bits: Optional[int] = None,
            q_group_size: Optional[int] = None, overwrite: bool = False,
            q_mode: str = "affine", quantize: bool = True,
            max_shard_bytes: int = MAX_FILE_SIZE_GB << 30, shard: Optional[str] = None,
            partition: Optional[str] = None) -> Path:
    """An unquantized source is quantized as `mlx_lm.convert -q --q-mode q_mode` does
    (bits and group size default to the mode's), unless `quantize` is False. The resident
    weights go in shards of at most `max_shard_bytes`, as mlx-lm's save_model writes them.
    `shard` ("i/N") writes host i's share of the experts, as `partition` (a routing trace)
    deals them out, or round-robin."""
    host = parse_shard(shard) if shard is not None else None
    if partition is not None and host is None:
        raise ValueError("--partition: only with --shard i/N (a whole pack holds every "
                         "expert; hosts take their share of it with --partition at load)")
    src, dst = model_path(hf_path), Path(mlx_path)
    config = json.loads((src / "config.json").read_text())
    # a family mlx-lm does not run, or a model without routed experts, is refused now
    find_experts(config, src / "config.json")
    dst.parent.mkdir(parents=True, exist_ok=True)
    with DestinationLock(dst):  # one convert per destination at a time
        return _convert_locked(src, dst, overwrite, q_bits, q_group_size, q_mode, quantize,
                               max_shard_bytes, host, partition)


def _convert_locked(src: Path, dst: Path, overwrite, q_bits, q_group_size, q_mode, quantize,
                    max_shard_bytes, host, partition) -> Path:
    old = dst.parent / f".{dst.name}.old"
    if old.exists() and not dst.exists() and is_pack(old):  # an --overwrite cut mid-swap:
        print(f"[edgemoe] restoring the pack an interrupted --overwrite moved aside: {dst}",
              file=sys.stderr)  # the old pack is the last whole one
        old.rename(dst)
    check_destination(src, dst, overwrite)
    model, tokenizer, config = mlx_lm_load(str(src), lazy=True, return_config=True)
    if "quantization" in config:
        q = config["quantization"]
        print(f"[edgemoe] {src} is already quantized ({q['bits']} bits, group "
              f"{q['group_size']}); keeping its quantization")
    else:
        _cast_like_mlx_lm(model, config)
        if quantize:
            model, config = quantize_model(model, config, q_group_size, q_bits, mode=q_mode)

    owners = _partition(model, src, host, partition)
    for left in dst.parent.glob(f".{glob.escape(dst.name)}.partial*"):  # we hold the lock:
        remove_ours(left, "an interrupted conversion's leftovers")  # no one writes them
    check_disk_space(dst, model, 1.0 if host is None else 1 / host[1])
    tmp = dst.parent / f".{dst.name}.partial-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    (tmp / OURS).touch()  # what we write, we may remove
    try:
        save_config(config, config_path=tmp / "config.json")  # its checksum: in the manifest
        _write_pack(tmp, model, config, max_shard_bytes, owners, host)
        tokenizer.save_pretrained(tmp)
        if (src / "generation_config.json").exists():
            shutil.copy(src / "generation_config.json", tmp)
        record_written_files(tmp, exclude={OURS})  # what --overwrite may remove, checksummed
        _verify_written(tmp)
        kept = keep_theirs(dst, tmp) if dst.exists() else []
        replace_with(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if kept:
        print(f"[edgemoe] kept from the pack it replaced (convert did not write them; made "
              f"for the old weights, check they still fit): {', '.join(kept)}",
              file=sys.stderr)
    return dst


def _verify_written(out: Path):
    """Read the pack back whole against its checksums: never report success for a pack
    that does not verify (a disk that lost a write, a concurrent writer)."""
    from .format.pack import Pack
    from .verify import check

    class Count:
        def update(self, n):
            pass

    try:
        check(Pack.open(out), Count())
    except PackError as e:
        raise PackError(f"the pack just written does not verify, so it was not put in "
                        f"place: {e}") from None


# what convert wrote into a pack whose manifest predates its "files" list: these exact
# names (mlx-lm's weights and tokenizer files); anything else (trained assets: prerouter/,
# adapter/, cache_policy.npz, a user's tokenizer_notes.md or vocab.backup) is not ours
def _cast_like_mlx_lm(model, config):
    """Cast floating weights to the checkpoint's dtype, as mlx_lm.convert does."""
    dtype = config.get("torch_dtype") or config.get("text_config", {}).get("dtype")
    if dtype not in CONVERSION_DTYPES:
        return
    dtype = getattr(mx, dtype)
    cast = getattr(model, "cast_predicate", lambda _: True)
    model.update(tree_map_with_path(
        lambda k, v: v.astype(dtype) if cast(k) and mx.issubdtype(v.dtype, mx.floating) else v,
        model.parameters(),
    ))


def _partition(model, src: Path, host, trace) -> Optional[Partition]:
    """Who owns which expert, for --shard (None: a whole pack)."""
    if host is None:
        return None
    layers = [SimpleNamespace(index=layer_index(path), num_experts=_num_experts(module))
              for path, module in expert_modules(model).items()]
    return make_partition(SimpleNamespace(layers=layers, shard=None, path=src), host[1], trace)


def _write_pack(out: Path, model, config, max_shard_bytes: int,
                partition: Optional[Partition] = None, host=None):
    """The experts, a layer at a time, then the resident weights a shard at a time: memory
    holds one layer of experts, then one shard. With a `partition`, only host `host[0]`'s
    experts are written."""
    paths, k = routed_experts(model, out)
    found = expert_modules(model)
    experts = {path: found[path] for path in paths}
    owned = partition.owned(host[0]) if partition is not None else {}
    writer = ExpertsWriter(out / EXPERTS_FILE)
    layers = []
    total = sum(_nbytes(m) * _share(owned.get(layer_index(p))) for p, m in experts.items())
    with tqdm(total=total, desc="experts", unit="B", unit_scale=True) as bar:
        for path, module in experts.items():
            layers.append(_write_layer(writer, path, module, bar, owned.get(layer_index(path))))
    size = writer.close()
    _write_resident(out, model, max_shard_bytes)
    write_manifest(out, config["model_type"], k, layers, size,
                   shard=partition.shard_info(host[0]) if partition is not None else None)


def _share(owned: Optional[np.ndarray]) -> float:
    return 1.0 if owned is None else float(owned.mean())


def _write_resident(out: Path, model, max_shard_bytes: int):
    """Everything but the routed experts (already written and emptied), as mlx-lm's
    save_model writes a model: one model.safetensors, or shards with an index."""
    weights = {k: v for k, v in tree_flatten(model.parameters()) if v.size}
    shards, size = [{}], 0  # as mlx-lm's make_shards, whose limit is whole gigabytes
    for name, v in weights.items():
        if shards[-1] and size + v.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = v
        size += v.nbytes
    names = ([RESIDENT_FILE] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())},
             "weight_map": {k: names[i] for i, shard in enumerate(shards) for k in shard}}
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))  # as save_model donates
    del weights
    for i, name in enumerate(names):
        shard, shards[i] = shards[i], None  # a shard is freed once written
        mx.save_safetensors(str(out / name), shard, metadata={"format": "mlx"})
        del shard
    if len(names) > 1:
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        (out / SHARD_INDEX).write_text(json.dumps(index, indent=4))


def _nbytes(module) -> int:
    """Bytes of a module's weights, known from their shapes before they are computed."""
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def check_disk_space(dst: Path, model, share: float = 1.0):
    """Refuse before writing when the pack cannot fit on DST's disk (its size is known
    from the model's shapes: every weight, plus at most one alignment per record; a
    host's shard holds `share` of the experts)."""
    params = tree_flatten(model.parameters())
    modules = expert_modules(model).values()
    records = sum(_num_experts(m) for m in modules) * share
    experts = sum(_nbytes(m) for m in modules)
    needed = int(sum(v.nbytes for _, v in params) - experts * (1 - share)
                 + records * ALIGNMENT)
    free = shutil.disk_usage(dst.parent).free
    if needed > free:
        raise OSError(errno.ENOSPC, f"the pack needs {needed / 1e9:.2f} GB, the disk has "
                                    f"{free / 1e9:.2f} GB free", str(dst.parent))


def _num_experts(module) -> int:
    return next(v for _, v in tree_flatten(module.parameters())).shape[0]


def _write_layer(writer: ExpertsWriter, path: str, module, bar,
                 owned: Optional[np.ndarray] = None) -> PackLayer:
    """Write one layer's experts (those `owned`, if given), computed (read, cast,
    quantized) only now, then drop them from the model: memory holds one layer of experts
    whatever the model's size."""
    params = dict(tree_flatten(module.parameters()))
    mx.eval(params)
    arrays = {k: _as_numpy(v) for k, v in params.items()}
    dtypes = {k: str(v.dtype).removeprefix("mlx.core.") for k, v in params.items()}
    layout = record_layout(arrays, dtypes)
    records = []
    for e in range(next(iter(arrays.values())).shape[0]):
        if owned is not None and not owned[e]:
            records.append(None)  # another host's
            continue
        records.append(writer.write([arrays[t.name][e] for t in layout]))
        bar.update(records[-1].length)
    layer = PackLayer(path, layer_index(path), layout, _quantization(module), records)
    module.update(tree_unflatten([(k, mx.zeros((0,), v.dtype)) for k, v in params.items()]))
    del params, arrays
    mx.clear_cache()
    return layer


def _as_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:  # numpy has no bfloat16; keep the bits
        a = a.view(mx.uint16)
    return np.array(a, copy=False)


def _quantization(module) -> dict:
    quant = {}
    for name, child in module.children().items():
        if isinstance(child, QuantizedSwitchLinear):
            quant[name] = {"group_size": child.group_size, "bits": child.bits,
                           "mode": child.mode, "global_scale": child.global_scale is not None}
        elif hasattr(child, "weight"):
            quant[name] = None
    return quant


@tool("convert")
def main(argv=None):
    parser = argparse.ArgumentParser(description="Convert an MoE checkpoint to an edgemoe pack.")
    parser.add_argument("--hf-path", "--model", required=True,
                        help="Hugging Face checkpoint, or an mlx-lm quantized one: a folder, "
                             "or a hub id (org/name[@revision]), downloaded into the hub cache")
    parser.add_argument("--mlx-path", default="edgemoe_model", help="Where to write the pack")
    parser.add_argument("--q-bits", type=int, help="Bits per weight (default: the mode's, 4)")
    parser.add_argument("--q-group-size", type=int,
                        help="Group size (default: the mode's: affine 64, mxfp4 32, nvfp4 16)")
    parser.add_argument("--q-mode", default="affine", choices=Q_MODES,
                        help="Quantization mode, as mlx_lm.convert's (default: affine)")
    parser.add_argument("--no-quantize", action="store_true",
                        help="Keep an unquantized source's weights unquantized")
    parser.add_argument("--overwrite", action="store_true", help="Replace an existing DST")
    parser.add_argument("--shard", metavar="i/N", default=None,
                        help="Write host i's pack of N (counted from 0) for --distributed: "
                             "the resident weights and host i's share of the experts")
    parser.add_argument("--partition", metavar="TRACE", default=None,
                        help="With --shard: share the experts out by the routing in this "
                             "trace (edgemoe.generate --trace), so hosts do equal work "
                             "(default: round-robin)")
    args = tool_parser(parser, "convert").parse_args(argv)
    from .hub import resolve

    dst = convert(resolve(args.hf_path), args.mlx_path, args.q_bits, args.q_group_size, args.overwrite,
                  args.q_mode, not args.no_quantize, shard=args.shard,
                  partition=args.partition)
    print(f"[edgemoe] wrote {dst}")


if __name__ == "__main__":
    main()
