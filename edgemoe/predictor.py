"""Predictors of routing, for advisory prefetch (and, later, predicted routing).

A predictor sees each MoE layer's input (the post-attention-norm hidden state) and
the experts its router chose, and returns the experts it expects some later layer
to need: {decoder layer index: expert ids}. The store prefetches them; in advisory
mode the native router still decides, so a wrong guess costs reads, never quality.
"""

from typing import Dict, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .prerouter import gate_logits, routing_from_logits


class Predictor(Protocol):
    def predict(self, layer: int, hidden: mx.array, routed: np.ndarray) -> Dict[int, np.ndarray]:
        ...


class NextRouterPredictor:
    """The free baseline: the next MoE layer's own router applied to this layer's input."""

    def __init__(self, blocks: Dict[int, nn.Module]):
        layers = sorted(blocks)
        self.next = {a: (b, blocks[b]) for a, b in zip(layers, layers[1:])}

    def predict(self, layer, hidden, routed):
        if layer not in self.next:
            return {}
        target, block = self.next[layer]
        inds, _ = routing_from_logits(block, gate_logits(block, hidden))
        return {target: np.array(inds)}
