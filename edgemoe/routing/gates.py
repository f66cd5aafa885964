"""The family's own routing math, from router logits, and a gate that routes by a prediction.

`routing_from_logits(block, logits)` applies a MoE block's routing (softmax top-k,
sigmoid group routing, renormalisation, ...) to logits, so that predicted logits pick
and weigh experts exactly as the native router would have from the same logits.
`PredictedGate` stands in for a block's router in the prerouted modes.
"""

from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.deepseek_v3 import MoEGate, group_expert_select
from mlx_lm.models.mixtral import MixtralSparseMoeBlock
from mlx_lm.models.olmoe import OlmoeSparseMoeBlock
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from ..format.families import UnsupportedModelError, layer_index


def native_gate(block: nn.Module) -> nn.Module:
    """The block's own router module, also while a PredictedGate stands in for it."""
    gate = block.gate
    return gate.native if isinstance(gate, PredictedGate) else gate


def gate_logits(block: nn.Module, x: mx.array) -> mx.array:
    """The router logits a MoE block's own router computes for its input `x`."""
    gate = native_gate(block)
    if isinstance(gate, MoEGate):  # its __call__ also routes; take the logits alone
        return x @ gate.weight.T
    return gate(x)


def routing_from_logits(block: nn.Module, logits: mx.array) -> Tuple[mx.array, mx.array]:
    """(indices, weights) that `block` routes to given router logits, by the family's math.

    Mirrors each mlx-lm block's `__call__` operation for operation, so native logits give
    the native block's indices (in the same order) and weights bit for bit.
    """
    if isinstance(native_gate(block), MoEGate):  # DeepSeek-V3
        return _group_select(native_gate(block), logits)
    if isinstance(block, Qwen3MoeSparseMoeBlock):
        k = block.top_k
        gates = mx.softmax(logits, axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if block.norm_topk_prob:
            scores /= mx.sum(scores, axis=-1, keepdims=True)
        return inds, scores
    if isinstance(block, OlmoeSparseMoeBlock):
        k = block.top_k
        gates = mx.softmax(logits, axis=-1, precise=True)
        inds = mx.stop_gradient(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
        scores = mx.take_along_axis(gates, inds, axis=-1)
        if block.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        return inds, scores
    if isinstance(block, MixtralSparseMoeBlock):
        k = block.num_experts_per_tok
        inds = mx.stop_gradient(mx.argpartition(-logits, kth=k - 1, axis=-1)[..., :k])
        scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1, precise=True)
        return inds, scores
    raise UnsupportedModelError(f"{type(block).__name__}: no routing math for this MoE block")


def restrict_logits(logits: mx.array, allowed: mx.array) -> mx.array:
    """Router logits with every expert outside `allowed` ((..., m) ids per token) at -inf:
    routing_from_logits then picks, and weighs, among the allowed experts only (the
    native router confined to a predicted set)."""
    inside = (allowed[..., None] == mx.arange(logits.shape[-1])).any(axis=-2)
    return mx.where(inside, logits, mx.array(-mx.inf, dtype=logits.dtype))


def _group_select(g: MoEGate, logits: mx.array) -> Tuple[mx.array, mx.array]:
    """DeepSeek-V3's routing (sigmoid, score bias, group-limited top-k, scaling) as
    mlx-lm's MoEGate does it."""
    return group_expert_select(logits, g.e_score_correction_bias, g.top_k, g.n_group,
                               g.topk_group, g.routed_scaling_factor, g.norm_topk_prob)


def uses_sigmoid(block: nn.Module) -> bool:
    """True where the router scores experts independently (sigmoid), not by a softmax."""
    return isinstance(native_gate(block), MoEGate)


class PredictedGate(nn.Module):
    """Stands in for a MoE block's gate so that the block routes by a prediction.

    `set_prediction(logits)`: router logits for the block's input tokens, (..., E); the
    gate returns what the native gate returns for those logits (the logits themselves,
    or DeepSeek's (indices, weights)), and the block's own code does the rest of its
    routing math. `set_prediction(allowed=ids)`: the native router, confined to the
    predicted experts (..., m). Rows of NaN logits or of ids -1 (no prediction: the
    first token of a sequence) route natively. A prediction is used once; with none
    pending the native router decides.
    """

    def __init__(self, native: nn.Module):
        super().__init__()
        self.native = native
        self.set_prediction(None)

    def set_prediction(self, logits: Optional[mx.array] = None,
                       allowed: Optional[mx.array] = None):
        # plain attributes, not parameters
        object.__setattr__(self, "predicted", logits)
        object.__setattr__(self, "allowed", allowed)

    def __call__(self, x: mx.array):
        predicted, allowed = self.predicted, self.allowed
        self.set_prediction(None)
        if predicted is None and allowed is None:
            return self.native(x)
        native = x @ self.native.weight.T if isinstance(self.native, MoEGate) else self.native(x)
        if allowed is not None:
            allowed = allowed.reshape(*x.shape[:-1], allowed.shape[-1])
            confined = restrict_logits(native, allowed)
            logits = mx.where(allowed[..., :1] < 0, native, confined)
        else:
            predicted = predicted.reshape(*x.shape[:-1], predicted.shape[-1])  # OLMoE flattens
            logits = mx.where(mx.isnan(predicted), native, predicted.astype(native.dtype))
        if isinstance(self.native, MoEGate):
            return _group_select(self.native, logits)
        return logits


def moe_blocks(model: nn.Module) -> Dict[int, nn.Module]:
    """MoE blocks by decoder layer index: native (mlx-lm) or with streaming experts."""
    return {layer_index(path): module for path, module in model.named_modules()
            if "gate" in module and "switch_mlp" in module}


def num_experts(block: nn.Module) -> int:
    return int(native_gate(block).weight.shape[0])


def top_k(block: nn.Module) -> int:
    return int(getattr(block, "top_k", None) or block.num_experts_per_tok)


def multi_hot(indices: mx.array, n: int) -> mx.array:
    """(..., k) expert ids -> (..., n) float32 with ones at those ids (on the device)."""
    return (indices[..., None] == mx.arange(n)).any(axis=-2).astype(mx.float32)
