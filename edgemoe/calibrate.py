"""This machine measured on a model's own shapes, for doctor's forecast: the disk's read
rate over the model's expert records (cold, and what the page cache already holds), and
the compute of one expert, a MoE layer's routing and a whole decoder layer (MLX)."""

import json
import os
import random
import statistics
import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .format.pack import Pack, PackLayer

DISK_RECORDS = 16  # records read per calibration
COMPUTE_REPEATS = 20


@dataclass
class Disk:
    record_bytes: int
    found_rate: float  # bytes/s, the page cache as it was
    found_hot: int  # of DISK_RECORDS, records wholly in the page cache before reading
    cold_rate: float  # bytes/s, after dropping other records from the page cache
    cold_hot: int  # records the drop failed to evict (then cold_rate is optimistic)


def in_page_cache(fd: int, offset: int, length: int, buf: memoryview) -> bool:
    """Whether a read would be served from the page cache (RWF_NOWAIT: no disk I/O)."""
    try:
        return os.preadv(fd, [buf[:length]], offset, os.RWF_NOWAIT) == length
    except (BlockingIOError, AttributeError, OSError):
        return False


def calibrate_disk(pack: Pack, seed: int = 0) -> Disk:
    records = [r for l in pack.layers for r in l.records if r is not None]
    rng = random.Random(seed)
    chosen = rng.sample(records, min(2 * DISK_RECORDS, len(records)))
    found, cold = chosen[::2], chosen[1::2] or chosen[::2]
    buf = memoryview(bytearray(max(length for r in chosen for _, _, length in r.segments)))
    fds = [os.open(f, os.O_RDONLY) for f in pack.files]
    try:
        def timed(rs):
            hot = sum(all(in_page_cache(fds[i], offset, length, buf)
                          for i, offset, length in r.segments) for r in rs)
            tic = time.perf_counter()
            for r in rs:
                for i, offset, length in r.segments:
                    os.preadv(fds[i], [buf[:length]], offset)
            return sum(r.length for r in rs) / (time.perf_counter() - tic), hot

        found_rate, found_hot = timed(found)
        for r in cold:
            for i, offset, length in r.segments:
                os.posix_fadvise(fds[i], offset, length, os.POSIX_FADV_DONTNEED)
        cold_rate, cold_hot = timed(cold)
    finally:
        for fd in fds:
            os.close(fd)
    return Disk(int(statistics.mean(r.length for r in chosen)), found_rate, found_hot,
                cold_rate, cold_hot)


def expert_compute_seconds(layer: PackLayer, repeats: int = COMPUTE_REPEATS) -> float:
    """One token through one expert of this layer's record shapes and quantization,
    in float32 (on CPU, bf16 activations or scales are many times slower)."""
    rng = np.random.default_rng(0)
    by_projection = {}
    for t in layer.tensors:
        by_projection.setdefault(t.projection, {})[t.kind] = t
    index = mx.array([0], dtype=mx.uint32)
    outs = []
    for name, parts in by_projection.items():
        weight = parts["weight"]
        q = layer.quantization.get(name)
        if q is None:
            w = mx.array(rng.normal(0, 0.02, weight.shape).astype(np.float32))[None]
            x = mx.random.normal((1, 1, weight.shape[1]))
            outs.append(mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=index))
            continue
        w = mx.array(rng.integers(0, 2**32, weight.shape, dtype=np.uint32))[None]
        scales = mx.array(rng.uniform(0, 0.01, parts["scales"].shape).astype(np.float32))[None]
        biases = parts.get("biases")
        if biases is not None:
            biases = mx.array(rng.uniform(-0.01, 0.01, biases.shape).astype(np.float32))[None]
        x = mx.random.normal((1, 1, weight.shape[1] * 32 // q["bits"]))
        outs.append(mx.gather_qmm(x, w, scales, biases, rhs_indices=index, transpose=True,
                                  group_size=q["group_size"], bits=q["bits"],
                                  mode=q.get("mode", "affine")))
    times = []
    for _ in range(repeats + 3):
        tic = time.perf_counter()
        mx.eval([o + 0 for o in outs])  # a fresh graph each time: nothing cached
        times.append(time.perf_counter() - tic)
    return statistics.median(times[3:])


def layer_overhead_seconds(pack: Pack, repeats: int = COMPUTE_REPEATS) -> float:
    """The host round trip edgemoe makes at each streamed MoE layer of a decode step, on
    the pack's router shape: routing synced to the host (its one sync,
    edgemoe.mlx_backend.hostsync), the slot table looked up and sent back, with negligible
    compute."""
    experts = pack.layers[0].num_experts
    dim = pack.layers[0].tensors[0].shape[-1]  # an input width; only the shape matters
    x = mx.random.normal((1, 1, dim))
    gate = mx.random.normal((experts, dim))
    table = np.arange(experts)
    times = []
    for _ in range(repeats + 3):
        tic = time.perf_counter()
        ids = np.array(mx.argpartition(x @ gate.T, kth=-pack.top_k, axis=-1)[..., -pack.top_k:])
        mx.array(table[np.unique(ids)].astype(np.uint32))
        times.append(time.perf_counter() - tic)
    return statistics.median(times[3:])


def decoder_layer_seconds(pack: Pack, steps: int = COMPUTE_REPEATS):
    """(seconds per decoder layer, seconds per token outside the layers) of one decode
    step, timed on mlx-lm's own model class for this config with one and with two
    layers of random weights, quantized as the pack is: Python, graph building and
    small kernels included. No weight of the pack is read."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import _get_classes

    config = json.loads((pack.path / "config.json").read_text())
    quant = config.get("quantization")
    times = []
    for layers in (1, 2):
        cfg = dict(config, num_hidden_layers=layers, first_k_dense_replace=0,
                   mlp_only_layers=[])
        model_class, args_class = _get_classes(cfg)
        model = model_class(args_class.from_dict(cfg))
        if quant:
            nn.quantize(model, quant["group_size"], quant["bits"],
                        class_predicate=lambda _, m: hasattr(m, "to_quantized")
                        and m.weight.shape[-1] % quant["group_size"] == 0)
        mx.eval(model.parameters())
        cache = make_prompt_cache(model)
        token = mx.array([[1]])
        step = []
        for _ in range(steps + 3):
            tic = time.perf_counter()
            mx.eval(model(token, cache=cache))
            step.append(time.perf_counter() - tic)
        times.append(statistics.median(step[3:]))
        del model, cache
    per_layer = max(times[1] - times[0], 0.0)
    return per_layer, max(times[0] - per_layer, 0.0)


def resident_compute_bytes(pack: Pack) -> int:
    """Resident bytes a token computes with: all but the embedding tables (a lookup),
    and, for a checkpoint read in place, its routed experts. From safetensors headers."""
    skip = tuple(l.module + "." for l in pack.layers)
    total = 0
    for f in pack.path.glob("model*.safetensors"):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            if name == "__metadata__" or "embed_tokens" in name or name.startswith(skip):
                continue
            start, end = info["data_offsets"]
            total += end - start
    return total
