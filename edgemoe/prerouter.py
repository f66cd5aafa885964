"""Prerouter heads: predict the next MoE layer's routing a token ahead.

A head for target layer l+1 runs while token t passes MoE layer l. Its input is the
vector that layer l's MoE block receives (the post-attention-norm hidden state at token
t) and layer l's routing at tokens t and t-1 (multi-hot over its experts). It outputs
router logits for layer l+1 at token t+1 (`same_token=False`, a whole token of lead
time, as Edge0) or at token t (`same_token=True`: more accurate, one layer of lead).
`routing_from_logits` applies the target block's own routing math to those logits, so
predicted routing picks and weighs experts exactly as the native router would have from
the same logits.

    prerouter = load_prerouter("adapters/<model>/prerouter")
    logits = prerouter.logits(target, x, routed_now, routed_prev)   # (..., num_experts)
    indices, weights = routing_from_logits(blocks[target], logits)

Heads are saved as `prerouter.safetensors` + `prerouter_config.json` in one folder.
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.deepseek_v3 import MoEGate, group_expert_select
from mlx_lm.models.mixtral import MixtralSparseMoeBlock
from mlx_lm.models.olmoe import OlmoeSparseMoeBlock
from mlx_lm.models.qwen3_moe import Qwen3MoeSparseMoeBlock

from .families import UnsupportedModelError, layer_index

WEIGHTS = "prerouter.safetensors"
CONFIG = "prerouter_config.json"


# -- the family's routing math, from logits -----------------------------------------

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


# -- the heads -----------------------------------------------------------------------

@dataclass
class PrerouterConfig:
    model_type: str
    hidden_size: int  # of the model: the MoE blocks' input
    num_experts: int
    top_k: int
    sources: Dict[int, int]  # target MoE layer -> the MoE layer its head runs at
    head_hidden: int = 256
    same_token: bool = False  # predict layer l+1 of token t, not of token t+1
    native_layers: List[int] = field(default_factory=list)  # keep the native router here

    @classmethod
    def for_model(cls, model_type: str, hidden_size: int, blocks: Dict[int, nn.Module],
                  head_hidden: int = 256, same_token: bool = False,
                  native_layers: Sequence[int] = ()) -> "PrerouterConfig":
        """A head for every MoE layer but the first (it has no previous MoE layer)."""
        layers = sorted(blocks)
        first = blocks[layers[0]]
        return cls(model_type, hidden_size, num_experts(first), top_k(first),
                   dict(zip(layers[1:], layers[:-1])), head_hidden, same_token,
                   sorted({layers[0], *native_layers}))

    @property
    def targets(self) -> List[int]:
        return sorted(self.sources)

    @property
    def predicted_layers(self) -> List[int]:
        """Targets whose routing a prerouted mode takes from the heads."""
        return [t for t in self.targets if t not in self.native_layers]

    def to_json(self) -> dict:
        d = asdict(self)
        d["sources"] = {str(t): s for t, s in self.sources.items()}
        return d

    @classmethod
    def from_json(cls, d: dict) -> "PrerouterConfig":
        d = dict(d)
        d["sources"] = {int(t): int(s) for t, s in d["sources"].items()}
        return cls(**d)


class PrerouterHead(nn.Module):
    """A small MLP: [norm(x), routing at t, routing at t-1] -> router logits of the target."""

    def __init__(self, hidden_size: int, num_experts: int, head_hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size)
        self.up = nn.Linear(hidden_size + 2 * num_experts, head_hidden)
        self.down = nn.Linear(head_hidden, num_experts)

    def __call__(self, x: mx.array, now: mx.array, prev: mx.array) -> mx.array:
        h = mx.concatenate([self.norm(x.astype(mx.float32)), now, prev], axis=-1)
        return self.down(nn.silu(self.up(h)))


class Prerouter(nn.Module):
    """All heads of one model, keyed by target decoder layer (`heads["layer_<l>"]`)."""

    def __init__(self, config: PrerouterConfig):
        super().__init__()
        self.config = config
        self.heads = {f"layer_{t}": PrerouterHead(config.hidden_size, config.num_experts,
                                                   config.head_hidden)
                      for t in config.targets}

    def head(self, target: int) -> PrerouterHead:
        return self.heads[f"layer_{target}"]

    def logits(self, target: int, x: mx.array, routed_now: mx.array,
               routed_prev: Optional[mx.array] = None) -> mx.array:
        """Predicted router logits of `target` from its source layer's input `x` (..., D)
        and that layer's expert ids (..., k) at this token and the previous one (None:
        no previous token). Token t+1's logits, or token t's when `same_token`."""
        n = self.config.num_experts
        now = multi_hot(routed_now, n)
        prev = mx.zeros_like(now) if routed_prev is None else multi_hot(routed_prev, n)
        return self.head(target)(x, now, prev)

    def route(self, target: int, block: nn.Module, x: mx.array, routed_now: mx.array,
              routed_prev: Optional[mx.array] = None) -> Tuple[mx.array, mx.array]:
        """Predicted (indices, weights) of `target` (whose MoE block is `block`)."""
        return routing_from_logits(block, self.logits(target, x, routed_now, routed_prev))


def save_prerouter(prerouter: Prerouter, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / WEIGHTS), dict(tree_flatten(prerouter.parameters())))
    (path / CONFIG).write_text(json.dumps(prerouter.config.to_json(), indent=1))
    return path


def load_prerouter(path) -> Prerouter:
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name}: no such file; is {path} a prerouter "
                                    f"folder (python -m edgemoe.train_prerouter --out ...)?")
    prerouter = Prerouter(PrerouterConfig.from_json(json.loads((path / CONFIG).read_text())))
    prerouter.load_weights(str(path / WEIGHTS), strict=True)
    prerouter.eval()
    mx.eval(prerouter.parameters())
    return prerouter


# -- advisory prediction -------------------------------------------------------------

class PrerouterPredictor:
    """The trained heads as a Predictor (edgemoe.predictor): at each MoE layer it predicts
    the expert ids of every target whose head runs there.

    It keeps each layer's routing of the previous token itself (the heads' t-1 input):
    call `reset()` between requests. A next-token prerouter returns, for each sequence,
    the ids its last token predicts for the next token; a same-token one returns the
    ids for every token of the call.
    """

    def __init__(self, prerouter: Prerouter, blocks: Dict[int, nn.Module]):
        self.prerouter = prerouter
        self.blocks = blocks
        self.targets_of: Dict[int, List[int]] = {}
        for target, source in prerouter.config.sources.items():
            self.targets_of.setdefault(source, []).append(target)
        self.previous: Dict[int, mx.array] = {}  # layer -> (B, k) ids of the last token

    @property
    def same_token(self) -> bool:
        return self.prerouter.config.same_token

    def reset(self):
        self.previous.clear()

    def predict(self, layer: int, hidden: mx.array, routed: np.ndarray) -> Dict[int, np.ndarray]:
        k = routed.shape[-1]
        if hidden.ndim == 2:  # a block that flattens its tokens (OLMoE): one sequence
            hidden = hidden[None]
        x = hidden.reshape(hidden.shape[0], -1, hidden.shape[-1])
        now = mx.array(routed.reshape(x.shape[0], x.shape[1], k).astype(np.int32))
        last = self.previous.get(layer)
        if last is None or last.shape != (x.shape[0], k):
            last = mx.full((x.shape[0], k), -1, dtype=mx.int32)  # -1: no expert, all zeros
        prev = mx.concatenate([last[:, None], now[:, :-1]], axis=1)
        self.previous[layer] = now[:, -1]
        predictions = {}
        for target in self.targets_of.get(layer, []):
            if self.same_token:
                xs, nows, prevs = x, now, prev
            else:  # only the last token's head output is about a token still to come
                xs, nows, prevs = x[:, -1], now[:, -1], prev[:, -1]
            inds, _ = self.prerouter.route(target, self.blocks[target], xs, nows, prevs)
            predictions[target] = np.array(inds)
        return predictions


class PreroutedPredictor(PrerouterPredictor):
    """Predicted routing: the heads' prediction *is* the routing of the predicted layers.

    Run at MoE layer l on token t, a next-token head gives layer l+1's logits for token
    t+1. Within one call (a prompt of L tokens) position p routes by the prediction made
    at position p-1; the call's last prediction is kept for the next call's first token
    and its experts are returned, so the store reads them a whole token ahead. The first
    token of a sequence, and the configured native layers, route natively.
    `confine=True` is `prerouted-set`: the predicted set, weighed by the native router.
    """

    def __init__(self, prerouter: Prerouter, blocks: Dict[int, nn.Module], confine=False):
        if prerouter.config.same_token:
            raise ValueError("prerouted routing needs next-token heads (trained without "
                             "--same-token)")
        super().__init__(prerouter, blocks)
        self.confine = confine
        self.predicted_layers = set(prerouter.config.predicted_layers)
        for target in self.predicted_layers:
            if not isinstance(blocks[target].gate, PredictedGate):
                blocks[target].gate = PredictedGate(blocks[target].gate)
        self.carry: Dict[int, mx.array] = {}  # target -> (B, 1, E) logits for the next call

    def reset(self):
        super().reset()
        self.carry.clear()

    def predict(self, layer, hidden, routed):
        targets = self.targets_of.get(layer, [])
        if hidden.ndim == 2:  # a block that flattens its tokens (OLMoE): one sequence
            hidden = hidden[None]
        x = hidden.reshape(hidden.shape[0], -1, hidden.shape[-1])
        k = routed.shape[-1]
        now = mx.array(routed.reshape(x.shape[0], x.shape[1], k).astype(np.int32))
        last = self.previous.get(layer)
        if last is None or last.shape != (x.shape[0], k):
            last = mx.full((x.shape[0], k), -1, dtype=mx.int32)
        prev = mx.concatenate([last[:, None], now[:, :-1]], axis=1)
        self.previous[layer] = now[:, -1]
        ahead = {}
        for target in targets:
            logits = self.prerouter.logits(target, x, now, prev)  # (B, L, E): position p+1
            if target not in self.predicted_layers:
                ahead[target] = np.array(routing_from_logits(self.blocks[target],
                                                             logits[:, -1])[0])
                continue
            first = self.carry.get(target)
            if first is None or first.shape[0] != x.shape[0]:
                first = mx.full((x.shape[0], 1, logits.shape[-1]), mx.nan)
            shifted = mx.concatenate([first, logits[:, :-1]], axis=1)
            self.carry[target] = logits[:, -1:]
            block = self.blocks[target]
            if self.confine:
                inds = routing_from_logits(block, mx.nan_to_num(shifted, nan=0.0))[0]
                inds = mx.where(mx.isnan(shifted[..., :1]), -1, inds.astype(mx.int32))
                block.gate.set_prediction(allowed=inds)
            else:
                block.gate.set_prediction(shifted)
            ahead[target] = np.array(routing_from_logits(block, logits[:, -1])[0])
        return ahead
