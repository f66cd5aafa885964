"""Prerouter heads: predict the next MoE layer's routing a token ahead.

A head for target layer l+1 runs while token t passes MoE layer l. Its input is the
vector that layer l's MoE block receives (the post-attention-norm hidden state at token
t) and layer l's routing at token t and at the token before it (multi-hot over its
experts). It outputs router logits for layer l+1 at token t+1 (`same_token=False`, a
whole token of lead time, as Edge0) or at token t (`same_token=True`: more accurate, one
layer of lead). The first MoE layer has no head: it keeps its router.
The target block's own code turns those logits into routing (edgemoe.mlx_backend.gates), so
predicted routing picks and weighs experts exactly as the native router would have from
the same logits.

    prerouter = load_prerouter("PACK/prerouter")
    logits = prerouter.logits(target, x, routed_now, routed_prev)   # (..., num_experts)
    indices = indices_from_logits(blocks[target], logits)

Heads are saved as `prerouter.safetensors` + `prerouter_config.json` in one folder
(edgemoe.routing.heads_config: the config, as both backends read it).
"""

import json
from pathlib import Path
from typing import Dict, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .gates import indices_from_logits, multi_hot, num_experts, top_k
from ..routing.heads_config import CONFIG, HEAD_HIDDEN, WEIGHTS, PrerouterConfig, read_config

def config_for_model(model_type: str, hidden_size: int, blocks: Dict[int, nn.Module],
                     *args, **kwargs) -> PrerouterConfig:
    """Heads for a model's MoE `blocks`: PrerouterConfig.for_layers with their layers and
    their routers' sizes (`args`, `kwargs`: its options from same_token on)."""
    first = blocks[min(blocks)]
    return PrerouterConfig.for_layers(model_type, hidden_size, sorted(blocks),
                                      num_experts(first), top_k(first), *args, **kwargs)


class PrerouterHead(nn.Module):
    """A small MLP: [norm(x), routing at t, routing at t-1] -> router logits of the
    target."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.norm = nn.RMSNorm(hidden_size)
        self.up = nn.Linear(hidden_size + 2 * num_experts, HEAD_HIDDEN)
        self.down = nn.Linear(HEAD_HIDDEN, num_experts)

    def __call__(self, x: mx.array, *routed: mx.array) -> mx.array:
        """`routed`: the multi-hots [now, prev], or both as one (decode: one op fewer)."""
        h = nn.silu(self.up(mx.concatenate([self.norm(x.astype(mx.float32)), *routed],
                                           axis=-1)))
        return self.down(h)


class Prerouter(nn.Module):
    """All heads of one model, keyed by target decoder layer (`heads["layer_<l>"]`)."""

    def __init__(self, config: PrerouterConfig):
        super().__init__()
        self.config = config
        self.heads = {f"layer_{t}": PrerouterHead(config.hidden_size, config.num_experts)
                      for t in config.targets}

    def head(self, target: int) -> PrerouterHead:
        return self.heads[f"layer_{target}"]

    def logits(self, target: int, x: mx.array, routed_now: mx.array,
               routed_prev: Optional[mx.array] = None) -> mx.array:
        """Predicted router logits of `target` from its source layer's input `x` (..., D)
        and that layer's expert ids (..., k) at this token and the previous one (None, or
        ids -1: none). Token t+1's logits, or token t's when `same_token`."""
        if routed_prev is None:
            routed_prev = mx.full(routed_now.shape, -1)
        recent = mx.stack([routed_now, routed_prev.astype(routed_now.dtype)], axis=-2)
        return self.logits_of_recent(target, x, recent)

    def logits_of_recent(self, target: int, x: mx.array, recent: mx.array) -> mx.array:
        """As `logits`, given the source layer's ids at this token and the previous one as
        one array (..., 2, k), most recent first."""
        hot = multi_hot(recent, self.config.num_experts)  # (..., 2, E)
        return self.head(target)(x, hot.reshape(*hot.shape[:-2], -1))

    def route(self, target: int, block: nn.Module, x: mx.array, routed_now: mx.array,
              routed_prev: Optional[mx.array] = None) -> mx.array:
        """Predicted expert ids of `target` (whose MoE block is `block`)."""
        return indices_from_logits(block, self.logits(target, x, routed_now, routed_prev))


def save_prerouter(prerouter: Prerouter, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(path / WEIGHTS), dict(tree_flatten(prerouter.parameters())))
    (path / CONFIG).write_text(json.dumps(prerouter.config.to_json(), indent=1))
    return path


def load_prerouter(path) -> Prerouter:
    path = Path(path)
    prerouter = Prerouter(read_config(path))
    prerouter.load_weights(str(path / WEIGHTS), strict=True)
    prerouter.eval()
    mx.eval(prerouter.parameters())
    return prerouter
