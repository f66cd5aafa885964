"""Prerouter heads: predict the next MoE layer's routing a token ahead.

A head for target layer l+1 runs while token t passes MoE layer l. Its input is the
vector that layer l's MoE block receives (the post-attention-norm hidden state at token
t) and layer l's routing at token t and at the `history` tokens before it (multi-hot over
its experts; 1 by default, Edge0 reads 2). It outputs
router logits for layer l+1 at token t+1 (`same_token=False`, a whole token of lead
time, as Edge0) or at token t (`same_token=True`: more accurate, one layer of lead).
With `first_layer`, the first MoE layer has a head too, run at the last MoE layer: it
wraps around, predicting the first layer's routing of token t+1 in either variant. It only
reads ahead: the first layer always keeps its router (routed by such a head, the bundled
model's decode perplexity went from 79 to 352). With `inputs` > 1 a head also reads the
inputs of the MoE layers before its source (at the same token), and with `depth` > 1 it
has more hidden layers.
The target block's own code turns those logits into routing (edgemoe.routing.gates), so
predicted routing picks and weighs experts exactly as the native router would have from
the same logits.

    prerouter = load_prerouter("PACK/prerouter")
    logits = prerouter.logits(target, x, routed_now, routed_prev)   # (..., num_experts)
    indices = indices_from_logits(blocks[target], logits)

Heads are saved as `prerouter.safetensors` + `prerouter_config.json` in one folder. A
folder of next-token heads may hold a correction, same-token heads for the same layers,
in its subfolder `correction/` (`load_correction`): the prerouted modes then route by the
correction and read the next-token prediction a token ahead
(edgemoe.routing.predictors.PreroutedPredictor).
"""

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .gates import indices_from_logits, multi_hot, num_experts, top_k

WEIGHTS = "prerouter.safetensors"
CONFIG = "prerouter_config.json"
CORRECTION = "correction"  # same-token heads beside next-token ones (a subfolder)


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
    first_layer: bool = False  # a head for the first MoE layer, run at the last one
    history: int = 1  # earlier tokens whose routing (at the source layer) a head reads
    inputs: int = 1  # MoE layers whose input a head reads: its source and those before it
    depth: int = 1  # hidden layers of a head

    @classmethod
    def for_model(cls, model_type: str, hidden_size: int, blocks: Dict[int, nn.Module],
                  head_hidden: int = 256, same_token: bool = False,
                  native_layers: Sequence[int] = (), first_layer: bool = False,
                  history: int = 1, inputs: int = 1, depth: int = 1) -> "PrerouterConfig":
        """A head for every MoE layer but the first (it has no previous MoE layer), and
        with `first_layer` one for the first, run at the last (the next token's): it only
        reads ahead, the first layer keeping its router."""
        layers = sorted(blocks)
        first = blocks[layers[0]]
        sources = dict(zip(layers[1:], layers[:-1]))
        native = {layers[0], *native_layers}
        if first_layer:
            sources[layers[0]] = layers[-1]
        for name, value in (("history", history), ("inputs", inputs), ("depth", depth)):
            if value < 1:
                raise ValueError(f"prerouter {name} {value}: at least 1")
        return cls(model_type, hidden_size, num_experts(first), top_k(first), sources,
                   head_hidden, same_token, sorted(native), first_layer, history, inputs,
                   depth)

    def input_layers(self, target: int) -> List[Optional[int]]:
        """The MoE layers whose inputs (at the head's token) `target`'s head reads: its
        source, then the `inputs - 1` MoE layers before it (None: before the first)."""
        layers = sorted(set(self.sources) | set(self.sources.values()))
        at = layers.index(self.sources[target])
        return [layers[at - j] if at - j >= 0 else None for j in range(self.inputs)]

    def wraps(self, target: int) -> bool:
        """Whether `target`'s head runs at a later layer: it predicts the next token."""
        return target <= self.sources[target]

    def shift(self, target: int) -> int:
        """1: `target`'s head predicts the next token's routing; 0: this token's."""
        return 0 if self.same_token and not self.wraps(target) else 1

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
    """A small MLP: [norm(x), routing at t, routing at t-1, ..., t-history] -> router
    logits of the target (`prev`: the earlier tokens' multi-hots, most recent first).
    With `inputs` > 1, x is the inputs of that many MoE layers, concatenated; with
    `depth` > 1, the MLP has that many hidden layers."""

    def __init__(self, hidden_size: int, num_experts: int, head_hidden: int,
                 history: int = 1, inputs: int = 1, depth: int = 1):
        super().__init__()
        self.norm = nn.RMSNorm(inputs * hidden_size)
        self.up = nn.Linear(inputs * hidden_size + (1 + history) * num_experts, head_hidden)
        if depth > 1:  # (absent at depth 1: the weights of such heads stay as they were)
            self.deep = [nn.Linear(head_hidden, head_hidden) for _ in range(depth - 1)]
        self.down = nn.Linear(head_hidden, num_experts)

    def __call__(self, x: mx.array, *routed: mx.array) -> mx.array:
        """`routed`: the multi-hots [now, prev], or both as one (decode: one op fewer)."""
        h = nn.silu(self.up(mx.concatenate([self.norm(x.astype(mx.float32)), *routed],
                                           axis=-1)))
        for layer in getattr(self, "deep", ()):
            h = nn.silu(layer(h))
        return self.down(h)


class Prerouter(nn.Module):
    """All heads of one model, keyed by target decoder layer (`heads["layer_<l>"]`)."""

    def __init__(self, config: PrerouterConfig):
        super().__init__()
        self.config = config
        self.heads = {f"layer_{t}": PrerouterHead(config.hidden_size, config.num_experts,
                                                   config.head_hidden, config.history,
                                                   config.inputs, config.depth)
                      for t in config.targets}

    def head(self, target: int) -> PrerouterHead:
        return self.heads[f"layer_{target}"]

    def logits(self, target: int, x: mx.array, routed_now: mx.array,
               routed_prev: Optional[mx.array] = None) -> mx.array:
        """Predicted router logits of `target` from its source layer's input `x` (..., D;
        with `inputs` > 1 those of `config.input_layers(target)`, concatenated)
        and that layer's expert ids (..., k) at this token and the earlier ones: (..., k)
        for the previous token, or (..., h, k) for h of them, most recent first (None, or
        ids -1: none). Token t+1's logits, or token t's when `same_token`."""
        history, k = self.config.history, routed_now.shape[-1]
        if routed_prev is None:
            routed_prev = mx.full((*routed_now.shape[:-1], 1, k), -1)
        elif routed_prev.ndim == routed_now.ndim:
            routed_prev = routed_prev[..., None, :]
        routed_prev = routed_prev[..., :history, :]
        if routed_prev.shape[-2] < history:  # -1: none
            pad = mx.full((*routed_prev.shape[:-2], history - routed_prev.shape[-2], k), -1)
            routed_prev = mx.concatenate([routed_prev, pad.astype(routed_prev.dtype)], axis=-2)
        recent = mx.concatenate([routed_now[..., None, :], routed_prev], axis=-2)
        return self.logits_of_recent(target, x, recent)

    def logits_of_recent(self, target: int, x: mx.array, recent: mx.array) -> mx.array:
        """As `logits`, given the source layer's ids at this token and the `history` before
        it as one array (..., 1 + history, k), most recent first."""
        hot = multi_hot(recent, self.config.num_experts)  # (..., 1 + h, E)
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
    for name in (CONFIG, WEIGHTS):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name}: no such file; is {path} a prerouter "
                                    f"folder (python -m edgemoe.train_prerouter --out ...)?")
    prerouter = Prerouter(PrerouterConfig.from_json(json.loads((path / CONFIG).read_text())))
    prerouter.load_weights(str(path / WEIGHTS), strict=True)
    prerouter.eval()
    mx.eval(prerouter.parameters())
    return prerouter


def load_correction(path) -> Optional[Prerouter]:
    """The same-token heads a next-token heads folder carries in `correction/`, or None."""
    folder = Path(path) / CORRECTION
    return load_prerouter(folder) if folder.is_dir() else None
