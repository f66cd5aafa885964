"""The streaming expert module: an mlx-lm `SwitchGLU` whose experts live in slots.

It computes with mlx-lm's own expert module (same projections, same activation, same
`gather_qmm` calls), built over the layer's slot pool instead of all experts, with the
router's expert ids remapped to slot ids. `gather_qmm` over a compact pool with
remapped indices gives bit-identical results (shared/GUIDE.md).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear

from .families import expert_modules
from .pack import PackError, PackLayer
from .store import ExpertStore, LayerSlots


class MLXSlotMemory:
    """A layer's slots as MLX arrays in unified memory, filled in place: the reader's
    rows are numpy views of the arrays. Compute evaluates before it releases slots
    (StreamingExperts), so no device ordering is needed here."""

    def __init__(self, layer: PackLayer, num_slots: int):
        self.arrays, self._rows = {}, {}
        for t in layer.tensors:
            self.arrays[t.name], self._rows[t.name] = _slot_array(num_slots, t.shape, t.dtype)
        self._names = [t.name for t in layer.tensors]

    def rows(self, slot: int):
        return [self._rows[name][slot] for name in self._names]

    def before_read(self, slot: int):
        pass

    def after_read(self, slot: int):
        pass

    def acquire(self, slots: np.ndarray):
        pass

    def release(self, slots: np.ndarray):
        pass


def _slot_array(num_slots: int, shape, dtype: str):
    """An MLX array of (num_slots, *shape) and a writable numpy view of its memory."""
    storage = {"bfloat16": np.uint16}.get(dtype, dtype)
    host = mx.array(np.zeros((num_slots, *shape), dtype=storage))
    mx.eval(host)
    view = np.asarray(host)  # shares the MLX buffer: preadv into it fills the array
    array = host.view(mx.bfloat16) if dtype == "bfloat16" else host
    return array, view


class StreamingExperts(nn.Module):
    """Drop-in replacement for a MoE block's `switch_mlp`; holds no parameters."""

    def __init__(self, slots: LayerSlots):
        super().__init__()
        self.slots = slots  # a plain object: not a parameter of the model

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        ids = np.array(indices)  # the host learns this layer's routing here (a sync)
        store = self.slots.store
        if store.trace is not None:
            store.trace.record(self.slots.layer.index, ids)
        experts = np.unique(ids)
        if len(experts) > self.slots.num_slots:
            return self._in_passes(x, ids, experts)
        slot_of = self.slots.ensure(experts)
        store.advise(self.slots.layer.index, x, ids)  # prefetches overlap this compute
        out = self.slots.pool(x, mx.array(slot_of[ids].astype(np.uint32)))
        mx.eval(out)  # every read of the slots is done before any can be refilled
        self.slots.release()
        return out

    def _in_passes(self, x: mx.array, ids: np.ndarray, experts: np.ndarray) -> mx.array:
        """More distinct experts than slots (a long prefill under a small budget):
        compute the (token, k) rows in groups of experts that fit the pool."""
        k = ids.shape[-1]
        flat_ids = ids.reshape(-1)
        tokens = x.reshape(-1, x.shape[-1])
        rows, outs = [], []
        for start in range(0, len(experts), self.slots.num_slots):
            group = experts[start:start + self.slots.num_slots]
            slot_of = self.slots.ensure(group, new_call=start == 0)
            if start == 0:
                self.slots.store.advise(self.slots.layer.index, x, ids)
            row = np.flatnonzero(np.isin(flat_ids, group))
            slots = slot_of[flat_ids[row]].astype(np.uint32)[:, None]
            y = self.slots.pool(tokens[mx.array(row // k)], mx.array(slots))
            mx.eval(y)
            self.slots.release()
            rows.append(row)
            outs.append(y[:, 0])
        order = np.argsort(np.concatenate(rows))
        out = mx.concatenate(outs)[mx.array(order)]
        return out.reshape(*ids.shape, out.shape[-1])


def build_pool(module: nn.Module, slots: LayerSlots) -> nn.Module:
    """Turn a freshly built mlx-lm expert module into one over the slot arrays.

    Its projections are quantized exactly as the pack's manifest records, then their
    (still lazy, never evaluated) random weights are replaced by the slot arrays.
    """
    for name, child in list(module.children().items()):
        if name not in slots.layer.quantization:
            continue
        q = slots.layer.quantization[name]
        if q is not None:
            child = child.to_quantized(q["group_size"], q["bits"], mode=q["mode"])
            assert isinstance(child, QuantizedSwitchLinear)
        for t in slots.layer.tensors:
            if t.projection == name:
                setattr(child, t.kind, slots.arrays[t.name])
        setattr(module, name, child)
    module.freeze()
    return module


def install(model: nn.Module, store: ExpertStore) -> dict:
    """Replace every routed-expert module of `model` by a streaming one; return the
    MoE blocks by decoder layer index.

    The checkpoint's own expert tensors (present in an mlx-lm checkpoint read in
    place) are dropped from the weights mlx-lm loads: they are never read whole.
    """
    found = expert_modules(model)
    if set(found) != set(store.layers):
        raise PackError(
            f"{store.pack.path}: the manifest's MoE layers do not match the model's "
            f"(manifest: {len(store.layers)}, model: {len(found)})"
        )
    blocks = {}
    for path, module in found.items():
        slots = store.layers[path]
        slots.pool = build_pool(module, slots)
        parent_path, name = path.rsplit(".", 1)
        parent = model
        for part in parent_path.split("."):
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        setattr(parent, name, StreamingExperts(slots))
        blocks[slots.layer.index] = parent
    sanitize = getattr(model, "sanitize", lambda weights: weights)
    prefixes = tuple(f"{path}." for path in found)
    model.sanitize = lambda weights: {k: v for k, v in sanitize(weights).items()
                                      if not k.startswith(prefixes)}
    return blocks
