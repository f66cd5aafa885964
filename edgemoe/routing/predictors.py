"""Predictors of routing: from a MoE layer's input and routing, the experts later layers
will need.

`predict(state, layer, x, ids)` sees one call of MoE layer `layer`: its input `x`
(rows, L, D), the expert ids its router chose `ids` (rows, L, k), and the calling
sequence's RoutingState. It returns {(target layer, lead): expert ids}, all of them lazy
MLX arrays: the caller evaluates them together with the layer's own routing, so that a
prediction costs no host sync of its own. The lead is 0 when the prediction is about
this call (the same token), 1 when it is about the next call (the next token, a whole
token ahead).

- NextRouterPredictor: the free baseline, the next layer's own router on this input.
- HeadsPredictor: trained prerouter heads (advisory: the router still decides).
- PreroutedPredictor: the heads' prediction *is* the routing of the predicted layers.
"""

from typing import Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn

from .gates import RouterTap, gate_logits, indices_from_logits, install_tap
from .prerouter import Prerouter
from .state import RoutingState


class NextRouterPredictor:
    """The next MoE layer's own router applied to this layer's input."""

    lead = 0
    # the predictions that read only while they earn it, by lead and by target (see
    # PreroutedPredictor); the others read as the store's gating says
    advisory_leads = advisory_targets = ()

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


class HeadsPredictor:
    """The trained heads: at each MoE layer, the expert ids of every target whose head
    runs there. A next-token head predicts, for each sequence, the ids of its next
    token; a same-token one the ids of every token of this call."""

    advisory_leads = advisory_targets = ()

    def __init__(self, prerouter: Prerouter, blocks: Dict[int, nn.Module]):
        self.prerouter = prerouter
        self.blocks = blocks
        self.targets_of: Dict[int, List[int]] = {}
        for target, source in prerouter.config.sources.items():
            self.targets_of.setdefault(source, []).append(target)
        # compiled, as the next router is: a head and its target's routing code cost no
        # Python on the decode path (the heads' weights are fixed once loaded)
        targets = prerouter.config.targets
        self.logits = {t: mx.compile(self._logits_of(t)) for t in targets}
        self.indices = {t: mx.compile(self._indices_of(blocks[t])) for t in targets}
        self.earlier = mx.compile(self._earlier_of(prerouter.config.history))
        self.input_layers = {s: prerouter.config.input_layers(t)
                             for t, s in prerouter.config.sources.items()}

    def _logits_of(self, target: int):
        return lambda x, recent: self.prerouter.logits_of_recent(target, x, recent)

    @staticmethod
    def _earlier_of(history: int):
        """(last `history` tokens' ids, this call's) -> (at each position, its ids and the
        earlier tokens', most recent first, the ids to keep for the next call)."""
        def earlier(last, ids):
            seq = mx.concatenate([last, ids.astype(mx.int32)], axis=1)
            length = ids.shape[1]
            recent = mx.stack([seq[:, history - j:history - j + length]
                               for j in range(history + 1)], axis=2)
            return recent, seq[:, -history:]
        return earlier

    @staticmethod
    def _indices_of(block: nn.Module):
        return lambda logits: indices_from_logits(block, logits)

    @property
    def same_token(self) -> bool:
        return self.prerouter.config.same_token

    @property
    def lead(self) -> int:
        return 0 if self.same_token else 1

    def routing_now(self, state: RoutingState, layer: int, ids: mx.array) -> mx.array:
        """At each position of this call, its ids (`ids`: rows, L, k) and the earlier
        tokens', (rows, L, 1 + history, k), most recent first; the last `history` tokens'
        ids are kept for the sequence's next call."""
        rows, length, k = ids.shape
        history = self.prerouter.config.history
        last = state.previous.get(layer)  # (rows, history, k), oldest first
        if last is None or last.shape != (rows, history, k):
            last = mx.full((rows, history, k), -1, dtype=mx.int32)  # -1: none, all zeros
        recent, state.previous[layer] = self.earlier(last, ids)
        return recent

    def block_inputs(self, state: RoutingState, layer: int, x: mx.array) -> mx.array:
        """What the heads at `layer` read of the model: its block input `x`, or with heads
        reading more than one layer's, this call's inputs of those layers concatenated
        (zeros for those before the first MoE layer)."""
        if self.prerouter.config.inputs == 1:
            return x
        state.inputs[layer] = x
        if layer not in self.input_layers:
            return x
        return mx.concatenate([mx.zeros_like(x) if l is None else state.inputs[l]
                               for l in self.input_layers[layer]], axis=-1)

    def lead_of(self, target: int) -> int:
        """How many of `target`'s calls pass before the one its head predicts: the next
        token's is 1 call away, but 0 for a head that wraps around (the first layer's,
        run at the last: the first layer's next call is the next token's)."""
        config = self.prerouter.config
        return config.shift(target) - config.wraps(target)

    def predict(self, state, layer, x, ids):
        recent = self.routing_now(state, layer, ids)
        x = self.block_inputs(state, layer, x)
        predictions = {}
        for target in self.targets_of.get(layer, []):
            if self.prerouter.config.shift(target):  # only the last token's head output
                xs, recents = x[:, -1], recent[:, -1]  # is about a token still to come
            else:
                xs, recents = x, recent
            predictions[target, self.lead_of(target)] = self.indices[target](
                self.logits[target](xs, recents))
        return predictions


class PreroutedPredictor(HeadsPredictor):
    """Predicted routing. Next-token heads: run at MoE layer l on token t, a head gives
    layer l+1's logits for token t+1. Within one call (a prompt of L tokens) position p
    routes by the prediction made at position p-1; the call's last prediction is carried
    in the sequence's state to its next call, and its experts are returned, so the store
    reads them a whole token ahead. The first token of a sequence, and the configured
    native layers, route natively. Same-token heads (trained with --same-token): a head
    run at layer l gives layer l+1's logits for this very call, which are its routing;
    its experts are read while layer l computes (a layer ahead: more accurate, less
    lead). `correction` (same-token heads beside next-token ones): the same-token
    prediction routes, and corrects the next-token one a layer before the layer runs;
    the next-token prediction only starts reads a token ahead, advisory (while what
    such reads waste stays within the store's waste budget), and of the corrected set
    only what those reads missed is read late. `confine=True` is `prerouted-set`: the
    predicted set, weighed by the native router. A first-layer head (run at the last
    layer, about the next token) only reads ahead, advisory: the first layer keeps its
    router.
    """

    def __init__(self, prerouter: Prerouter, blocks: Dict[int, nn.Module], confine=False,
                 correction: Optional[Prerouter] = None):
        super().__init__(prerouter, blocks)
        self.confine = confine
        config = prerouter.config
        self.wrapping = {t for t in config.targets if config.wraps(t)}  # read ahead only
        self.predicted_layers = set(config.predicted_layers) - self.wrapping
        self.advisory_targets = tuple(sorted(self.wrapping))
        self.correction = None
        if correction is not None:
            check_correction(config, correction.config)
            self.correction = HeadsPredictor(correction, blocks)
            # the next-token prediction no longer routes: it reads a token ahead only
            # while such reads earn it (the store's waste budget), as advisory prefetch
            self.advisory_leads = (1,)
        self.taps = {t: install_tap(blocks[t]) for t in sorted(self.predicted_layers)}
        # next-token predictions that route by themselves: the host knows a decode step's
        # routing of their layers before it runs (`fixes_next_call`)
        self.fixes = set() if confine or correction is not None else \
            {t for t in self.predicted_layers if config.shift(t)}

    def fixes_next_call(self, target: int) -> bool:
        """Whether `target`'s prediction made now is its routing for the next token's
        call, expert for expert (next-token heads routing, not confined to a set)."""
        return target in self.fixes

    @property
    def gates(self) -> List[RouterTap]:
        return list(self.taps.values())

    def predict(self, state, layer, x, ids):
        recent = self.routing_now(state, layer, ids)
        x = self.block_inputs(state, layer, x)
        predictions = {}
        for target in self.targets_of.get(layer, []):
            if target in self.wrapping:  # the first layer's next call: read ahead only
                logits = self.logits[target](x[:, -1], recent[:, -1])
                predictions[target, 0] = self.indices[target](logits)
                continue
            logits = self.logits[target](x, recent)  # (rows, L, E)
            # same-token: position p's routing, read now; next-token: position p+1's
            predictions[target, self.lead] = self.indices[target](
                logits if self.same_token else logits[:, -1])
            if self.correction is not None:  # the same-token prediction routes instead
                logits = self.correction.logits[target](x, recent)
                predictions[target, 0] = self.indices[target](logits)
            if target not in self.predicted_layers:
                continue
            routing = logits if self.same_token or self.correction is not None else \
                self._shifted(state, target, logits)
            if self.confine:
                inds = self.indices[target](mx.nan_to_num(routing, nan=0.0))
                inds = mx.where(mx.isnan(routing[..., :1]), -1, inds.astype(mx.int32))
                self.taps[target].set_prediction(allowed=inds)
            else:  # a decode step's routing the host knows is a prediction for every row
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


def check_correction(heads, correction):
    """A correction is same-token heads for the very targets and sources of next-token
    heads (PrerouterConfig each)."""
    if heads.same_token or not correction.same_token:
        raise ValueError("a prerouter correction is same-token heads (train_prerouter "
                         "--same-token) beside next-token ones")
    ahead = {t: s for t, s in heads.sources.items() if not heads.wraps(t)}
    if correction.sources != ahead or correction.num_experts != heads.num_experts:
        raise ValueError(f"the prerouter correction's heads (sources {correction.sources}) "
                         f"are not for the heads' layers (sources {ahead})")
