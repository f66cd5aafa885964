"""Prefill's matmuls through numpy's BLAS: an explicit, inexact option for CPUs.

MLX's CPU backend multiplies quantized weights at about 1 GFLOP/s (`gather_qmm`, and its
float32 matmul at about 2), where numpy's BLAS reaches 20 on the same two cores
(docs/benchmarks.md, "Prefill"). With `prefill_arithmetic="blas"`, a layer call with
enough (token, expert) entries per expert dequantizes each expert it uses once
(`mx.dequantize`: MLX's own dequantization, to float32) and multiplies all of that expert's
tokens in one BLAS matmul per projection; the resident quantized linears (attention's
projections, the LM head; never a router, whose choices would move) likewise, for calls of
at least MIN_DENSE_ROWS tokens; and attention's scaled dot product too (`blas_attention`),
in float32, a block of queries at a time. Decode steps and small calls keep mlx-lm's own
modules and functions, bit for bit.

The contract: not bit-identical to mlx-lm. The products are the same float32 products
summed in another order; tests/test_prefill_schedule.py holds the bundled model's prompt
logits within `LOGIT_TOLERANCE` of mlx-lm's, with the same greedy token at every position.
Native arithmetic stays the default everywhere.
"""

import contextlib
import contextvars
import ctypes
import sys
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map_with_path
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU, SwitchLinear

MIN_ROWS_PER_EXPERT = 12  # fewer: dequantizing an expert costs more than BLAS saves (8: 1.25x
# slower than gather_qmm here, 16: 1.8x faster)
MIN_DENSE_ROWS = 32  # the same for a resident linear
ROUTERS = ("gate", "router", "shared_expert_gate")  # linears never moved to BLAS
QUERY_BLOCK = 256  # attention's queries per block: bounds the scores' memory
# set during a forward call of a model loaded with BLAS arithmetic: the family module's
# attention function, patched for every model of the family, takes BLAS only then
_FORWARD = contextvars.ContextVar("edgemoe_blas_forward", default=False)
LOGIT_TOLERANCE = 1e-4  # max |logit - mlx-lm's| on the bundled model's prompt (measured: 1.05e-5)


class BlasExperts(SwitchGLU):
    """A pool's mlx-lm SwitchGLU (`SlotPool.module`) made anew over the same projections:
    the same call, (x (..., D), slot ids (..., k)) -> (..., k, D), through BLAS when the
    call is large. A projection set on it later (a LoRA's deltas, `bind_deltas`) is its
    own, as on mlx-lm's module, and then mlx-lm's call computes it (`supported`)."""

    def __init__(self, module: SwitchGLU):
        _same_state(self, module)  # (not SwitchGLU's own: it would make new projections)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if indices.size < MIN_ROWS_PER_EXPERT * 2 or supported(self) is not None:
            return super().__call__(x, indices)
        ids = np.array(indices).reshape(-1)
        used = np.unique(ids)
        if ids.size < MIN_ROWS_PER_EXPERT * len(used):
            return super().__call__(x, indices)
        k, dims = indices.shape[-1], x.shape[-1]
        rows = np.array(x.reshape(-1, dims).astype(mx.float32))
        out = expert_products(self, rows, k, ids, used)
        return mx.array(out).reshape(*indices.shape, -1).astype(x.dtype)


def expert_products(module: SwitchGLU, rows: np.ndarray, k: int, ids: np.ndarray,
                    used: np.ndarray) -> np.ndarray:
    """Each entry's expert output: rows (T, D) float32 tokens, each routed to k experts;
    ids (T * k,) their slots, entry i token i // k's; used (sorted distinct ids). Each
    expert is dequantized once and computes all its tokens together."""
    order = np.argsort(ids, kind="stable")
    bounds = np.searchsorted(ids[order], np.append(used, used[-1] + 1))
    gate_up = np.concatenate([dequantized(module.gate_proj, used),
                              dequantized(module.up_proj, used)], axis=1)  # (U, 2H, D)
    down = dequantized(module.down_proj, used)  # (U, D, H)
    hidden = gate_up.shape[1] // 2
    out = np.empty((len(ids), down.shape[1]), dtype=np.float32)
    for j in range(len(used)):
        mine = order[bounds[j]:bounds[j + 1]]
        projected = rows[mine // k] @ gate_up[j].T
        gate, up = projected[:, :hidden], projected[:, hidden:]
        out[mine] = (gate / (1 + np.exp(-gate)) * up) @ down[j].T  # silu(gate) * up
    return out


def dequantized(proj, slots: np.ndarray) -> np.ndarray:
    """The projection's weights of these slots as float32 (U, out, in), by MLX's own
    dequantization."""
    picked = mx.array(slots.astype(np.uint32))
    if isinstance(proj, QuantizedSwitchLinear):
        biases = proj["biases"][picked] if "biases" in proj else None
        weight = mx.dequantize(proj.weight[picked], proj.scales[picked], biases,
                               group_size=proj.group_size, bits=proj.bits, mode=proj.mode)
    else:
        weight = proj.weight[picked]
    return np.array(weight.astype(mx.float32))


def supported(module) -> Optional[str]:
    """None if BLAS can compute this expert module as mlx-lm would; else why not."""
    if type(module) not in (SwitchGLU, BlasExperts) or type(module.activation) is not SwiGLU:
        return f"{type(module).__name__} with {type(getattr(module, 'activation', None)).__name__}"
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = module[name]
        if type(proj) not in (QuantizedSwitchLinear, SwitchLinear) or "bias" in proj:
            return f"{name}: {type(proj).__name__}" + (" with a bias" if "bias" in proj else "")
        if getattr(proj, "global_scale", False):
            return f"{name}: a global scale"
    return None


class BlasLinear(nn.QuantizedLinear):
    """An mlx quantized linear made anew over the same weights (`use_blas` puts it in the
    other's place): a call of at least MIN_DENSE_ROWS rows dequantizes the weight once and
    multiplies through BLAS; a smaller one is the quantized linear's own."""

    def __init__(self, linear: nn.QuantizedLinear):
        _same_state(self, linear)  # (not QuantizedLinear's own: it would quantize a new weight)

    def __call__(self, x: mx.array) -> mx.array:
        rows = x.size // x.shape[-1]
        if rows < MIN_DENSE_ROWS or self.mode != "affine":
            return super().__call__(x)
        weight = np.array(mx.dequantize(self["weight"], self["scales"], self.get("biases"),
                                        group_size=self.group_size, bits=self.bits,
                                        mode=self.mode).astype(mx.float32))
        out = np.array(x.reshape(rows, -1).astype(mx.float32)) @ weight.T
        if "bias" in self:
            out += np.array(self["bias"].astype(mx.float32))
        return mx.array(out).reshape(*x.shape[:-1], -1).astype(x.dtype)


def _same_state(new: nn.Module, old: nn.Module):
    """Make `new`, a module not yet initialized, hold what `old` holds: its parameters and
    children (the same arrays and modules, shared), its settings (group_size, bits, ...),
    its frozen keys and its training mode."""
    nn.Module.__init__(new)
    for name, value in vars(old).items():
        if not name.startswith("_"):
            setattr(new, name, value)
    for name, value in old.items():
        setattr(new, name, value)
    new._no_grad, new._training = set(old._no_grad), old._training


def use_blas(model, experts: dict) -> int:
    """Give every streaming expert module whose expert module BLAS can compute the BLAS
    one (`experts`: layer index -> StreamingExperts), and put a BlasLinear in the place of
    every resident quantized linear but the routers; how many expert modules took it. A
    module with an adapter's deltas, or another activation, keeps mlx-lm's. The model's
    forward calls then enter the BLAS flag (`blas_forward`), and numpy's OpenBLAS runs on
    one thread (`blas_threads`)."""
    blas_threads(1)
    _blas_attention_in_family(model)
    model.streaming.forward_context = blas_forward

    def blas(path, module):
        if type(module) is nn.QuantizedLinear and path.rsplit(".", 1)[-1] not in ROUTERS:
            return BlasLinear(module)
        return module
    model.update_modules(tree_map_with_path(blas, model.leaf_modules(),
                                            is_leaf=nn.Module.is_module))
    taken = 0
    for module in experts.values():
        pool = module.pool
        if isinstance(pool.module, BlasExperts) or supported(pool.module) is not None:
            continue
        if any(type(c).__name__ == "ExpertDeltas" for c in module.children().values()):
            continue
        pool.module = BlasExperts(pool.module)
        taken += 1
    return taken


def blas_threads(count: int) -> bool:
    """Set numpy's OpenBLAS threads (the library this process loaded: Linux); whether it
    was found. Why one: an expert's matmul is small (its share of a chunk's tokens), and
    OpenBLAS's threads spin at each one's end: on these 2 cores, beside MLX's own threads
    and any other load, 2 threads made the BLAS path 18x slower than 1."""
    try:
        with open("/proc/self/maps") as maps:
            path = next((line.split()[-1] for line in maps if "openblas" in line), None)
    except OSError:
        return False
    if path is None:
        return False
    lib = ctypes.CDLL(path)
    for name in ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads"):
        setter = getattr(lib, name, None)
        if setter is not None:
            setter(count)
            return True
    return False


@contextlib.contextmanager
def blas_forward():
    """The BLAS flag, set for one forward call of a model loaded with BLAS arithmetic
    (entered by its `Streaming.forward_context`)."""
    token = _FORWARD.set(True)
    try:
        yield
    finally:
        _FORWARD.reset(token)


def _blas_attention_in_family(model):
    """Make the model's family module's attention function one that takes BLAS during a
    BLAS forward call (`blas_forward`), once per family. mlx-lm's modules of the family
    look the function up in that module at each call, so every model of the family in the
    process calls it: that is safe, since any other call, from a model loaded without the
    flag (mlx-lm's own, or edgemoe's native), finds the flag unset and goes straight to
    the original function, bit for bit (tests/test_prefill_schedule.py checks mlx-lm's
    model of the same family, in the same process, after a BLAS prefill)."""
    family = sys.modules[type(model).__module__]
    original = getattr(family, "scaled_dot_product_attention", None)
    if original is not None and not getattr(original, "blas", False):
        def attention(queries, keys, values, cache, scale, mask, sinks=None):
            if (not _FORWARD.get() or sinks is not None or hasattr(cache, "bits")
                    or queries.shape[2] < MIN_DENSE_ROWS):
                return original(queries, keys, values, cache=cache, scale=scale, mask=mask,
                                sinks=sinks)
            return blas_attention(queries, keys, values, scale, mask)
        attention.blas = True
        family.scaled_dot_product_attention = attention


def blas_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                   mask) -> mx.array:
    """mx.fast.scaled_dot_product_attention's result through numpy, in float32: queries
    (B, Hq, L, D), keys and values (B, Hkv, S, D) with Hq a multiple of Hkv; `mask` None,
    "causal" (the last L of S positions), a boolean (True: attend) or an additive array."""
    b, hq, length, _ = queries.shape
    hkv, span = keys.shape[1], keys.shape[2]
    q = np.array(queries.astype(mx.float32)).reshape(b, hkv, hq // hkv, length, -1)
    k = np.array(keys.astype(mx.float32))[:, :, None]
    v = np.array(values.astype(mx.float32))[:, :, None]
    given = None if mask is None or isinstance(mask, str) else np.array(mask)
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=np.float32)
    for start in range(0, length, QUERY_BLOCK):
        stop = min(start + QUERY_BLOCK, length)
        scores = (q[..., start:stop, :] * scale) @ np.swapaxes(k, -1, -2)
        if isinstance(mask, str):  # causal: query i sees keys up to its own position
            seen = np.arange(span)[None, :] <= (np.arange(start, stop) + span - length)[:, None]
            scores = np.where(seen, scores, -np.inf)
        elif given is not None:
            block = given[..., start:stop, :]
            block = block.reshape(block.shape[:1] + (-1,) + block.shape[-2:]) \
                if block.ndim == 4 and block.shape[1] == hq else block
            if block.dtype == np.bool_:
                scores = np.where(_per_group(block, hkv), scores, -np.inf)
            else:
                scores = scores + _per_group(block, hkv)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        out[..., start:stop, :] = scores @ v
    return mx.array(out.reshape(b, hq, length, -1)).astype(queries.dtype)


def _per_group(mask: np.ndarray, kv_heads: int) -> np.ndarray:
    """A mask over (B?, Hq?, L, S) shaped to broadcast over (B, Hkv, Hq/Hkv, L, S)."""
    if mask.ndim == 4 and mask.shape[1] > 1:
        return mask.reshape(mask.shape[0], kv_heads, -1, *mask.shape[-2:])
    return mask
