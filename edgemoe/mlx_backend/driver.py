"""The driver of the non-native routing modes (edgemoe.routing.modes), as the model
side calls it.

`PredictedRouting` runs a mode's predictor. The model's forward call
opens `sequence(inputs, cache)`, which makes the calling sequence's RoutingState current;
each streaming expert module calls `predict(layer, x, ids)` before its layer's routing
is evaluated, so the predictor's graph is evaluated in the same host sync, and hands the
evaluated predictions to `prefetch_all` once its own experts are in slots; that calls
`prefetch(layer, experts, lead)`, the only thing the expert store is told of routing.
"""

import contextlib
import math
from typing import Callable, Dict, Optional, Tuple

import mlx.core as mx
import numpy as np

from .state import RoutingState, sequence_state

# (layer index, expert ids, lead: edgemoe.streaming.store.ExpertStore.prefetch)
Prefetch = Callable[[int, np.ndarray, int], None]


class PredictedRouting:
    """Runs a predictor at each MoE layer on the current sequence's state."""

    def __init__(self, predictor, prefetch: Prefetch):
        self.predictor, self.prefetch = predictor, prefetch
        self.state: Optional[RoutingState] = None
        self.rows, self.length = 1, None  # of the current forward call

    @property
    def advisory(self) -> bool:
        """Its predictions only prefetch (the router decides): a predictor that never fixes
        a call's routing. A layer whose experts are all resident needs none of them."""
        return getattr(self.predictor, "fixes_next_call", None) is None

    @contextlib.contextmanager
    def sequence(self, inputs: Optional[mx.array], cache):
        """One forward call of the sequence(s) that own `cache` ((rows, L) `inputs`)."""
        outer = self.state, self.rows, self.length
        self.state = sequence_state(cache)
        self.state.calls += 1
        self.rows = inputs.shape[0] if inputs is not None and inputs.ndim > 1 else 1
        self.length = None if inputs is None else inputs.shape[1 if inputs.ndim > 1 else 0]
        try:
            yield self.state
        finally:
            self.state, self.rows, self.length = outer
            for gate in getattr(self.predictor, "gates", ()):
                gate.set_prediction(None)  # a prediction never outlives its forward call

    def predict(self, layer: int, x: mx.array,
                ids: mx.array) -> Dict[Tuple[int, int], mx.array]:
        """Layer `layer` routes its input `x` to `ids`: the predictions it makes, lazy (the
        caller evaluates them with `ids`, in one sync)."""
        state = self.state if self.state is not None else RoutingState()
        if x.ndim == 2:  # a block that flattens its tokens (OLMoE)
            x = x.reshape(self.rows, -1, x.shape[-1])
        x = x.reshape(-1, x.shape[-2], x.shape[-1])
        ids = ids.reshape(x.shape[0], x.shape[1], ids.shape[-1])
        predictions = self.predictor.predict(state, layer, x, ids)
        state.rows = x.shape[0]
        return predictions

    def prefetch_all(self, predictions: Dict[Tuple[int, int], np.ndarray],
                     made_in: Optional[Tuple[RoutingState, int]] = None):
        """Hand evaluated predictions, {(target layer, lead): experts}, to the store;
        `made_in`: the (state, call) that made them, when they were evaluated later than
        that call (`made_now`), else the current one."""
        state, calls = made_in if made_in is not None else \
            (self.state, self.state.calls if self.state is not None else 0)
        fixes = getattr(self.predictor, "fixes_next_call", None)
        for (target, lead), experts in predictions.items():
            self.prefetch(target, experts, lead)
            if fixes is not None and state is not None and fixes(target):
                state.known[target, calls + 1] = experts

    def made_now(self) -> Optional[Tuple[RoutingState, int]]:
        """The sequence state and call of predictions made now, for `prefetch_all` later."""
        return (self.state, self.state.calls) if self.state is not None else None

    def known_routing(self, layer: int, shape) -> Optional[np.ndarray]:
        """This call's expert ids of `layer` (shaped as its router's `shape`), when a
        prediction made in the sequence's last call fixed them and the host has them: a
        decode step of predicted routing; else None (the router's ids must be evaluated)."""
        state = self.state
        if state is None:
            return None
        ids = state.known.pop((layer, state.calls), None)
        if ids is None:
            return None
        for key in [k for k in state.known if k[1] < state.calls]:  # unused (a prefill's)
            del state.known[key]
        if self.length != 1 or ids.size != math.prod(shape):
            return None
        return ids.reshape(shape)
