"""The streaming expert module: an mlx-lm `SwitchGLU` whose experts live in slots.

It computes with mlx-lm's own expert module (same projections, same activation, same
`gather_qmm` calls), built over the layer's slot pool instead of all experts, with the
router's expert ids remapped to slot ids. `gather_qmm` over a compact pool with
remapped indices gives bit-identical results (tests/test_exact.py checks it per family).
"""

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Dict, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP
from mlx_lm.tuner.lora import LoRASwitchLinear

from ..format.pack import PackError, PackLayer
from .gates import BlockInput
from ..streaming.calls import run_call
from ..streaming.prefill_ahead import look_ahead
from ..streaming.slots import LayerSlots
from ..streaming.store import ExpertStore
from .hits_first import hits_first_call
from .hostsync import QueuedReads, wait
from .lora import ExpertDeltas, ExpertProjection
from .slots import CallSlotIds, live_table

# A native decode call with misses computes its hits (queued, `mx.async_eval`) while its misses
# are read (#50 item 3: edgemoe.mlx_backend.hits_first). Off: here a warm page cache's reads
# are shorter than the extra evaluation costs the host; the twin (edgemoe.whatif.twin) must
# show it pays on a Mac first.
HITS_FIRST = False


@dataclass
class Streaming:
    """What a model edgemoe loaded carries beside mlx-lm's (`streaming_of(model)`): its
    expert store; its share of the experts when it is one host of several
    (edgemoe.distributed.HostShare), whose outputs are summed at every MoE layer; and its
    predicted routing (edgemoe.routing.modes.PredictedRouting), None in native mode; and
    the device work its layers left queued (edgemoe.mlx_backend.hostsync).
    Every streaming expert module of the model holds this one object."""

    store: ExpertStore
    share: Optional[Any] = None
    routing: Optional[Any] = None
    queued: QueuedReads = field(default_factory=QueuedReads)
    # entered around each forward call: edgemoe.mlx_backend.prefill's BLAS flag, when loaded with it
    forward_context: Callable[[], ContextManager] = contextlib.nullcontext
    experts_per_token: Optional[Any] = None  # routing.modes.ExpertsPerToken, set at load


def streaming_of(model) -> Optional[Streaming]:
    """The streaming side of a model edgemoe loaded; None for a plain mlx-lm model."""
    return model.streaming if isinstance(model, StreamingModel) else None


@dataclass
class SlotPool:
    """A layer's slots and mlx-lm's expert module over their arrays (`build_pool`). A
    plain object: held by a module, neither is a child or a parameter of the model."""

    slots: LayerSlots
    module: nn.Module
    table: Optional[mx.array] = None  # expert -> slot on the device, live (`live_table`)
    slot_ids: CallSlotIds = field(default_factory=CallSlotIds)  # a call's, to the device


class StreamingExperts(nn.Module):
    """Drop-in replacement for a MoE block's `switch_mlp`; holds no parameters.

    It owns its compute pool: mlx-lm's own expert module over the layer's slot arrays
    (`build_pool`). Of the model's `streaming`: the routing, when set, is told of each
    call's routing (advisory and prerouted modes: edgemoe.mlx_backend.driver); the share, when
    set, makes it one host of several: it computes the rows routed to this host's experts,
    and the hosts' outputs are summed (edgemoe.distributed).

    Its children are named as the expert module's projections (`gate_proj`, ...), so that
    a LoRA of the routed experts in mlx-lm's format (keys `...switch_mlp.gate_proj.lora_a`)
    finds them: an `ExpertProjection` holds nothing; mlx-lm's `linear_to_lora_layers`
    turns it into `ExpertDeltas`, every expert's delta, which the pool then adds.
    """

    routed_experts = True  # what families.is_routed_experts looks for beside the switch layers

    def __init__(self, pool: SlotPool, streaming: Streaming):
        super().__init__()
        self.pool, self.streaming = pool, streaming  # plain objects: not children
        self.slots = pool.slots
        self.block_input = BlockInput()  # handed by its block (routing.gates.hand_input)
        projections = []
        for name, proj in pool.module.children().items():
            proj = getattr(proj, "linear", proj)  # (a LoRASwitchLinear of streamed deltas)
            if isinstance(proj, (SwitchLinear, QuantizedSwitchLinear)):
                setattr(self, name, ExpertProjection(pool.slots.layer.num_experts,
                                                     proj.input_dims, proj.output_dims))
                projections.append(name)
        # (a tuple attribute would be a child of the module: a string is not)
        self._projections = " ".join(projections)
        # a slot for every expert: the layer may turn resident (`LayerSlots.resident`)
        self._may_turn_resident = self.slots.num_slots >= self.slots.layer.num_experts

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        slots, streaming = self.slots, self.streaming
        routing, share, queued = streaming.routing, streaming.share, streaming.queued
        if routing is None and share is None and slots.trace is None and not HITS_FIRST \
                and indices.size <= slots.num_slots \
                and not (self._may_turn_resident and slots.resident):
            return self._decode_call(x, indices)  # (the common native decode call)
        layer = slots.layer.index
        queued.layer_calls[layer] = queued.layer_calls.get(layer, 0) + 1
        if share is None and slots.trace is None and slots.resident \
                and (routing is None or routing.advisory):  # (no read to advise)
            return self._resident_call(x, indices)
        predicted, ids = {}, None
        if routing is not None:
            seen = x if self.block_input.x is None else self.block_input.x
            self.block_input.x = None  # the block's next call hands its own
            predicted = routing.predict(layer, seen, indices)
            # a decode step of next-token predicted routing: the host has the ids already
            ids = routing.known_routing(layer, indices.shape)
        routed = None
        routed_natively = ids is None and self.pool.table is not None
        if ids is None:  # the layer's one sync: its routing, any prediction, and the work
            # earlier layers left queued, whose slots it then releases
            if routing is None and share is None:  # a long prefill's first pass reads
                look_ahead(slots, indices.size)  # while the sync computes attention
            queued.sync(indices, *predicted.values())
            slots.stats.host_syncs += 1
            if not predicted and share is None and not HITS_FIRST and slots.trace is None \
                    and indices.size <= slots.num_slots:
                return self._decode_call(x, indices, synced=True)
            ids = np.array(indices)
            if predicted:  # its prefetches overlap this layer's compute
                routed = lambda: self._prefetch(predicted)  # noqa: E731
        else:  # no routing sync: the predictions (about the next token) wait for the next
            # sync (the next token's first layer without known routing)
            queued.defer(predicted, functools.partial(
                prefetch_predictions, streaming, made_in=routing.made_now(),
                calls_then={t: queued.layer_calls.get(t, 0) for t, _ in predicted}))
        return self._routed_call(x, indices, ids, routed, routed_natively)

    def _routed_call(self, x: mx.array, indices: mx.array, ids: np.ndarray, routed,
                     routed_natively: bool) -> mx.array:
        """A call whose routing the host has (`ids`), in passes where its experts exceed
        the slots (edgemoe.streaming.calls.run_call); `routed`: what to start once its slots
        are claimed; `routed_natively`: `indices` are the router's own, as `ids`."""
        share, layer = self.streaming.share, self.slots.layer.index

        def compute(rows, slot_ids):
            self.bind_deltas()
            if rows is None:  # one pass: exactly mlx-lm's call, over the slots, left queued
                # (its slots stay in use until a sync has evaluated it: `queued.hold`);
                # the router's own ids, where they are the call's, map to slots on the device
                slot_ids = mx.take(self.pool.table, indices) if routed_natively else \
                    mx.array(slot_ids.astype(np.uint32))
                return self.pool.module(x, slot_ids)
            # (token, k) rows of this pass: evaluated, since the next pass refills slots
            tokens = x.reshape(-1, x.shape[-1])[mx.array(rows // ids.shape[-1])]
            out = self.pool.module(tokens, mx.array(slot_ids.astype(np.uint32)[:, None]))[:, 0]
            wait(out)
            self.slots.stats.host_syncs += 1
            return out

        if HITS_FIRST and share is None and self.streaming.routing is None:
            out = hits_first_call(self, x, ids)
            if out is not None:
                return out
        if share is not None:
            mine = np.flatnonzero(self.slots.owned[ids].reshape(-1))  # this host's rows
            parts = run_call(self.slots, ids, compute, routed, rows=mine)
            return share.combine(parts, ids.shape, layer)
        parts = run_call(self.slots, ids, compute, routed, hold=True)
        if len(parts) == 1 and parts[0][0] is None:
            self.streaming.queued.hold(self.slots, parts[0][1])
            return parts[0][1]
        # the passes' rows partition the entries: where each entry's output went, the
        # inverse of their concatenation (an O(n) scatter, not a sort)
        done = np.concatenate([rows for rows, _ in parts])
        order = np.empty_like(done)
        order[done] = np.arange(done.size, dtype=done.dtype)
        out = mx.concatenate([y for _, y in parts])[mx.array(order)]
        return out.reshape(*ids.shape, out.shape[-1])

    def _decode_call(self, x: mx.array, indices: mx.array, synced: bool = False) -> mx.array:
        """A native call of no more entries than slots (a decode step's): the layer's one
        sync (its routing), then, where the pool takes its experts at once
        (`LayerSlots.claim`: hits, and misses read into room it has), one pass of mlx-lm's
        call over the slots, left queued, its slots held until a sync has evaluated it; its
        ids to the host as Python ints (see LayerSlots), its slots to the device as an array
        of the host's (`CallSlotIds`); else the general path (`_routed_call`).

        In one function, few calls: after a sync the host's caches are cold, and each
        function the call runs costs there (an all-hit claim and release, in one function
        with the same work: 36 against 70 us, docs/benchmarks.md, session 38). A call needs
        no look-ahead (a prompt's: more entries than slots) and no prediction to make.
        `synced`: the caller has made the sync (a call with routing that predicted nothing)."""
        slots, queued = self.slots, self.streaming.queued
        if not synced:
            layer = slots.layer.index
            queued.layer_calls[layer] = queued.layer_calls.get(layer, 0) + 1
            queued.sync(indices)
            slots.stats.host_syncs += 1
        ids = indices.tolist()
        if indices.size == indices.shape[-1]:  # one token: [[...]] to [...]
            while ids and isinstance(ids[0], list):
                ids = ids[0]
        else:
            while ids and isinstance(ids[0], list):
                ids = [e for row in ids for e in row]
        fills = slots.claim(sorted(set(ids)))
        if fills is None:
            return self._routed_call(x, indices, np.array(indices), None,
                                     self.pool.table is not None)
        slot_ids = self.pool.slot_ids.of(list(map(slots.slot_ints.__getitem__, ids)),
                                         indices.shape)
        # built while the misses are read: it reads their slots once evaluated, after finish
        if ExpertDeltas.made:
            self.bind_deltas()
        out = self.pool.module(x, slot_ids)
        if fills:
            try:
                slots.finish(fills)
            except BaseException:  # (a failed read: the call's slots are free again)
                slots.release()
                raise
        queued.hold(slots, out)
        return out

    def _resident_call(self, x: mx.array, indices: mx.array) -> mx.array:
        """Every expert of the layer is in a slot: the router's ids are slot ids as they are
        (each expert in its own: `identity`, mlx-lm's own call), else become them on the
        device (`live_table`), so the call needs no host sync, as in mlx-lm; the experts it
        requested are counted on the device too (`QueuedReads.tally`)."""
        self.bind_deltas()
        slot_ids = indices if self.slots.identity else mx.take(self.pool.table, indices)
        out = self.pool.module(x, slot_ids)
        self.streaming.queued.tally(self.slots, indices, self.slots.layer.num_experts)
        return out

    def bind_deltas(self):
        """Give the pool the deltas of the experts in its slots (resident ExpertDeltas:
        gathered, so a trained delta gets its gradient)."""
        if not ExpertDeltas.made:  # (no LoRA of routed experts was ever made: none here)
            return
        deltas = [(n, self[n]) for n in self._projections.split()
                  if isinstance(self.get(n), ExpertDeltas)]
        if not deltas:
            return
        experts = mx.array(np.maximum(self.slots.expert_in, 0))  # a free slot is never read
        for name, delta in deltas:
            proj = self.pool.module[name]
            if not isinstance(proj, LoRASwitchLinear):
                proj = LoRASwitchLinear.from_base(proj, r=delta.rank, scale=delta.scale)
                setattr(self.pool.module, name, proj)
            proj.lora_a, proj.lora_b = delta.lora_a[experts], delta.lora_b[experts]

    def _prefetch(self, predicted: dict):
        """Hand evaluated predictions to the store (none: nothing)."""
        prefetch_predictions(self.streaming, predicted)


def prefetch_predictions(streaming: Streaming, predicted: dict, made_in=None,
                         calls_then: Optional[Dict[int, int]] = None):
    """Hand evaluated predictions, {(target layer, lead): ids}, to the routing's store
    (`made_in`: see PredictedRouting.prefetch_all). `calls_then`: each target layer's calls
    when they were made, if they were evaluated later: a lead counts the target's calls
    from when it was made, so the calls since come off it (a prediction whose call has
    passed is dropped)."""
    if calls_then is not None:
        now = streaming.queued.layer_calls
        predicted = {(t, lead - (now.get(t, 0) - calls_then[t])): p
                     for (t, lead), p in predicted.items()
                     if lead >= now.get(t, 0) - calls_then[t]}
    if predicted:
        streaming.routing.prefetch_all({t: np.array(p) for t, p in predicted.items()},
                                       made_in)


def expert_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """The routed-expert modules of a model, by module path, in layer order."""
    return {path: module for path, module in model.named_modules()
            if isinstance(module, (SwitchGLU, SwitchMLP))}


def build_pool(module: nn.Module, layer: PackLayer, arrays: Dict[str, mx.array]) -> nn.Module:
    """Turn a freshly built mlx-lm expert module into one over the slot arrays.

    Its projections are quantized exactly as the pack's manifest records, then their
    (still lazy, never evaluated) random weights are replaced by the slot arrays. A
    projection whose records carry an adapter's deltas becomes mlx-lm's LoRASwitchLinear
    over its slot arrays too.
    """
    for name, child in list(module.children().items()):
        if name not in layer.quantization:
            continue
        q = layer.quantization[name]
        if q is not None:  # nvfp4's per-expert global scale is one more tensor of the record
            child = child.to_quantized(q["group_size"], q["bits"], mode=q["mode"],
                                       global_scale=q.get("global_scale", False))
            assert isinstance(child, QuantizedSwitchLinear)
        tensors = {t.kind: arrays[t.name] for t in layer.tensors if t.projection == name}
        if "lora_a" in tensors:  # an adapter's delta, streamed with the expert
            child = LoRASwitchLinear.from_base(child, r=tensors["lora_a"].shape[1],
                                               scale=layer.lora_scale)
            base = child.linear
        else:
            base = child
        for kind, array in tensors.items():
            setattr(child if kind in ("lora_a", "lora_b") else base, kind, array)
        setattr(module, name, child)
    module.freeze()
    return module


def install(model: nn.Module, streaming: Streaming) -> Dict[int, StreamingExperts]:
    """Replace every routed-expert module of `model` by a streaming one of `streaming`'s
    store; return them by decoder layer index."""
    store = streaming.store
    found = expert_modules(model)
    if set(found) != set(store.layers):
        raise PackError(
            f"{store.info().path}: the manifest's MoE layers do not match the model's "
            f"(manifest: {len(store.layers)}, model: {len(found)})"
        )
    installed = {}
    queued = streaming.queued
    store.settle = queued.settle_tallies
    for path, module in found.items():
        slots = store.layers[path]
        slots.flush = queued.flush
        slots.read_whole = streaming.share is None  # (a host of several reads its share)
        pool = SlotPool(slots, build_pool(module, slots.layer, slots.arrays),
                        table=live_table(slots))
        experts = StreamingExperts(pool, streaming)
        parent_path, name = path.rsplit(".", 1)
        parent = model
        for part in parent_path.split("."):
            parent = parent[int(part)] if part.isdigit() else getattr(parent, part)
        setattr(parent, name, experts)
        installed[slots.layer.index] = experts
    return installed


class StreamingModel:
    """What streaming adds to mlx-lm's model class for a family (`streaming_class`):
    `streaming`, the model's Streaming (its store, share and routing), and
    `forward_hook`, called with each forward call's inputs (generation's split)."""

    streaming: Optional[Streaming] = None
    forward_hook = None

    @property
    def expert_store(self) -> ExpertStore:
        """The store of the model's experts (ExpertStore: `info()`, `snapshot()`, ...)."""
        return self.streaming.store


def streaming_class(model_class: type, expert_paths) -> type:
    """mlx-lm's model class for the family, with the two hooks streaming needs.

    `sanitize` drops the checkpoint's own routed-expert tensors (an mlx-lm checkpoint
    read in place has them): they are streamed, never loaded whole. `__call__` makes the
    calling sequence's routing state current while predicted routing runs
    (edgemoe.mlx_backend.driver).
    """
    prefixes = tuple(f"{path}." for path in expert_paths)

    class Streamed(model_class, StreamingModel):
        def sanitize(self, weights):
            weights = super().sanitize(weights) if hasattr(super(), "sanitize") else weights
            return {k: v for k, v in weights.items() if not k.startswith(prefixes)}

        def __call__(self, inputs, cache=None, **kwargs):
            given = inputs if inputs is not None else kwargs.get("input_embeddings")
            if self.forward_hook is not None:
                self.forward_hook(given)
            streaming = self.streaming
            streaming.queued.calls += 1
            try:
                with streaming.forward_context():
                    if streaming.routing is None:
                        return super().__call__(inputs, cache=cache, **kwargs)
                    with streaming.routing.sequence(given, cache):
                        return super().__call__(inputs, cache=cache, **kwargs)
            except BaseException:  # a failed call leaves no slot held: its earlier
                streaming.queued.flush()  # layers' queued compute is settled
                raise

    Streamed.__name__ = Streamed.__qualname__ = model_class.__name__
    Streamed.__module__ = model_class.__module__
    return Streamed
