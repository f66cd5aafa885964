"""Predictors of routing: from a MoE layer's input and routing, the experts later layers
will need.

`predict(state, layer, x, ids)` sees one call of MoE layer `layer`: its input `x`
(rows, L, D), the expert ids its router chose `ids` (rows, L, k), and the calling
sequence's RoutingState. It returns {(target layer, lead): expert ids}, all of them lazy
MLX arrays: the caller evaluates them together with the layer's own routing, so that a
prediction costs no host sync of its own. The lead is 0 when the prediction is about
this call (the same token), 1 when it is about the next call (the next token, a whole
token ahead).

- NextRouterPredictor: the free baseline, the next layer's own router on this input
  (advisory: the router still decides).
- PreroutedPredictor: the trained heads' prediction *is* the routing of the predicted
  layers.
"""

from typing import Callable, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .conditional import experts_per_token, install_conditional, set_top_k
from .gates import RouterTap, gate_logits, indices_from_logits, install_tap
from .prerouter import Prerouter, load_prerouter
from .state import RoutingState


class NextRouterPredictor:
    """The next MoE layer's own router applied to this layer's input."""

    lead = 0

    def __init__(self, blocks: Dict[int, nn.Module]):
        layers = sorted(blocks)
        # compiled: the block's own routing code is traced once per input shape, so a
        # prediction costs no Python on the decode path (the router's weights are fixed)
        self.next = {a: (b, mx.compile(self._router_of(blocks[b])))
                     for a, b in zip(layers, layers[1:])}

    @staticmethod
    def _router_of(block: nn.Module):
        return lambda x: indices_from_logits(block, gate_logits(block, x))

    def predict(self, state: RoutingState, layer: int, x: mx.array,
                ids: mx.array) -> Dict[int, mx.array]:
        if layer not in self.next:
            return {}
        target, route = self.next[layer]
        return {(target, 0): route(x)}


class PreroutedPredictor:
    """Predicted routing by the trained heads: at each MoE layer, the heads whose source it
    is predict their targets' routing, which is the routing of the predicted layers.

    Next-token heads: run at MoE layer l on token t, a head gives layer l+1's logits for
    token t+1. Within one call (a prompt of L tokens) position p routes by the prediction
    made at position p-1; the call's last prediction is carried in the sequence's state
    to its next call, and its experts are returned, so the store reads them a whole token
    ahead. The first token of a sequence, and the configured native layers, route
    natively. Same-token heads (trained with --same-token): a head run at layer l gives
    layer l+1's logits for this very call, which are its routing; its experts are read
    while layer l computes (a layer ahead: more accurate, less lead).
    """

    def __init__(self, prerouter: Prerouter, blocks: Dict[int, nn.Module],
                 slots: Optional[int] = None, new_policy: Optional[Callable] = None):
        """`slots`: each layer's slots (the store's; None: every expert), which
        cache-conditional heads (config.conditional) route among, simulated with
        `new_policy()` (the store's cache policy; needed by such heads)."""
        self.prerouter = prerouter
        config = prerouter.config
        if config.route_top_k:  # reduced top-k: every layer, native or predicted; beside
            #                    --experts-per-token, the smaller k wins
            set_top_k(blocks.values(), min(config.route_top_k, experts_per_token(blocks)))
        self.targets_of = config.targets_of
        # compiled, as the next router is: a head and its target's routing code cost no
        # Python on the decode path (the heads' weights are fixed once loaded)
        self.logits = {t: mx.compile(self._logits_of(t)) for t in config.targets}
        self.indices = {t: mx.compile(self._indices_of(blocks[t])) for t in config.targets}
        self.earlier = mx.compile(self._earlier)
        self.predicted_layers = set(config.predicted_layers)
        self.taps = {t: install_tap(blocks[t]) for t in sorted(self.predicted_layers)}
        # next-token predictions: the host knows a decode step's routing of their layers
        # before it runs (`fixes_next_call`)
        self.fixes = set() if self.same_token else set(self.predicted_layers)
        if config.conditional:  # the router decides among slots and the prediction, which
            #                    is read ahead: its heads' m most likely
            install_conditional(self, blocks, slots or config.num_experts, config.conditional,
                                new_policy)
            m = config.conditional
            self.indices = {t: mx.compile(lambda logits: mx.argpartition(-logits, m - 1,
                                                                         axis=-1)[..., :m])
                            for t in config.targets}

    def _logits_of(self, target: int):
        return lambda x, recent: self.prerouter.logits_of_recent(target, x, recent)

    @staticmethod
    def _earlier(last, ids):
        """(the last token's ids, this call's) -> (at each position, its ids and the
        previous token's, the ids to keep for the next call)."""
        seq = mx.concatenate([last, ids.astype(mx.int32)], axis=1)
        length = ids.shape[1]
        recent = mx.stack([seq[:, 1 - j:1 - j + length] for j in range(2)], axis=2)
        return recent, seq[:, -1:]

    @staticmethod
    def _indices_of(block: nn.Module):
        return lambda logits: indices_from_logits(block, logits)

    @property
    def same_token(self) -> bool:
        return self.prerouter.config.same_token

    @property
    def lead(self) -> int:
        return self.prerouter.config.lead

    @property
    def gates(self) -> List[RouterTap]:
        return list(self.taps.values())

    def fixes_next_call(self, target: int) -> bool:
        """Whether `target`'s prediction made now is its routing for the next token's
        call, expert for expert (next-token heads)."""
        return target in self.fixes

    def routing_now(self, state: RoutingState, layer: int, ids: mx.array) -> mx.array:
        """At each position of this call, its ids (`ids`: rows, L, k) and the previous
        token's, (rows, L, 2, k); the last token's ids are kept for the sequence's next
        call."""
        rows, length, k = ids.shape
        last = state.previous.get(layer)  # (rows, 1, k)
        if last is None or last.shape != (rows, 1, k):
            last = mx.full((rows, 1, k), -1, dtype=mx.int32)  # -1: none, all zeros
        recent, state.previous[layer] = self.earlier(last, ids)
        return recent

    def predict(self, state, layer, x, ids):
        recent = self.routing_now(state, layer, ids)
        predictions = {}
        for target in self.targets_of.get(layer, []):
            logits = self.logits[target](x, recent)  # (rows, L, E)
            # same-token: position p's routing, read now; next-token: position p+1's
            predictions[target, self.lead] = self.indices[target](
                logits if self.same_token else logits[:, -1])
            if target not in self.predicted_layers:
                continue
            routing = logits if self.same_token else self._shifted(state, target, logits)
            # a decode step's routing the host knows is a prediction for every row
            complete = (target, state.calls) in state.known
            self.taps[target].set_prediction(routing, fallback=not complete)
        return predictions

    @staticmethod
    def _shifted(state, target: int, logits: mx.array) -> mx.array:
        """Next-token logits as the routing of each position: the previous position's
        prediction, the call's first from the sequence's last call (NaN: none)."""
        first = state.carry.get(target)
        if first is None or first.shape[0] != logits.shape[0]:
            first = mx.full((logits.shape[0], 1, logits.shape[-1]), mx.nan)
        state.carry[target] = logits[:, -1:]
        if logits.shape[1] == 1:  # a decode step: its routing is the carried prediction
            return first
        return mx.concatenate([first, logits[:, :-1]], axis=1)


def predictor_for(mode, heads, blocks: Dict[int, nn.Module], slots: Optional[int] = None,
                  new_policy: Optional[Callable] = None):
    """The predictor of the routing mode `mode` (edgemoe.routing.modes) over the model's
    MoE `blocks` (gates.moe_blocks), with the heads folder `heads` and `slots` per layer
    (what cache-conditional heads route among, simulated with `new_policy()`: the store's
    cache policy); None in native. The same questions the CUDA backend asks a mode."""
    if mode.advisory:
        return NextRouterPredictor(blocks)
    if mode.routes:
        return PreroutedPredictor(load_prerouter(heads), blocks, slots, new_policy)
    return None
