"""A MoE block's routing, by the family's own code, from router logits.

Every MoE block of mlx-lm computes its router logits with one linear map, turns them into
(indices, weights) by its family's math (softmax or sigmoid, group top-k, score biases,
renormalisation, scaling ...), and calls its routed-expert module with the indices. The
linear map is the block's router itself (an `nn.Linear` named `gate` or `router`), a
Linear inside its router module (`gate.gate_proj`, `router.proj`, ...), or the router
module's own `weight` (DeepSeek's MoEGate: `x @ self.weight.T`).

edgemoe needs two things of a block: its logits alone (`gate_logits`: what predictors
learn), and its routing from other logits (`indices_from_logits`, and in the prerouted
modes the block's whole computation). Both come from the block's own code: a `RouterTap`
stands in for the linear map and records its output or replaces it by a prediction, and
the expert module is briefly replaced by one that records the indices it is called with.
No family's routing math is copied here, so a new family needs no code.
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from ..format.families import ROUTER_NAMES, UnsupportedModelError, layer_index
from .families import moe_block_paths, routed_indices

_LINEAR = (nn.Linear, nn.QuantizedLinear)


def moe_blocks(model: nn.Module) -> Dict[int, nn.Module]:
    """MoE blocks (the modules that route and call a routed-expert module) by decoder
    layer index."""
    modules = dict(model.named_modules())
    return dict(sorted((layer_index(experts), modules[block])
                       for experts, block in moe_block_paths(model).items()))


def router_name(block: nn.Module) -> str:
    name = next((n for n in ROUTER_NAMES if n in block and isinstance(block[n], nn.Module)),
                None)
    if name is None:
        raise UnsupportedModelError(f"{type(block).__name__}: no router module "
                                    f"(an attribute named {' or '.join(ROUTER_NAMES)})")
    return name


@dataclass
class BlockInput:
    """What its MoE block was last called with (`hand_input`): a plain object, read by the
    block's streaming experts (model.experts) and by train_prerouter's recording."""

    x: Optional[mx.array] = None


@dataclass
class TapCall:
    """A RouterTap's prediction for its next call, (logits, fallback), and the logits its
    native map last computed: a plain object, so never model parameters."""

    pending: tuple = (None, True)
    recorded: Optional[mx.array] = None


class RouterTap(nn.Module):
    """Stands in for a router's linear map (`native`): returns its logits, or a prediction.

    `set_prediction(logits)`: router logits for the tokens of the next call, (..., E);
    rows of NaN (no prediction: the first token of a sequence) keep the native logits.
    With `fallback=False` the caller knows no row is NaN: the native map is not computed
    (a decode step's carried prediction; logits given to `indices_from_logits`).
    A prediction is used once. `recorded` holds the last logits
    the native map computed. `inline` is a router module whose own `weight` is the map
    (`x @ self.weight.T`): the tap then stands in for the whole router and runs it on the
    logits through an identity weight, which reproduces them exactly. `hands_to`, when
    set, receives each input (`hand_input`): the map's input is its block's.
    """

    def __init__(self, native: nn.Module, inline: bool = False):
        super().__init__()
        self.native, self.inline = native, inline
        self.call = TapCall()
        self.hands_to: Optional[BlockInput] = None

    def set_prediction(self, logits: Optional[mx.array], fallback: bool = True):
        self.call = TapCall((logits, fallback))

    @property
    def pending(self) -> tuple:
        return self.call.pending

    @property
    def recorded(self) -> Optional[mx.array]:
        return self.call.recorded

    @property
    def num_experts(self) -> int:
        return int(self.native.weight.shape[0])

    @property
    def input_width(self) -> int:
        """The width of the MoE block's input, as the router's map takes it."""
        native = self.native
        if isinstance(native, nn.QuantizedLinear):
            return int(native.scales.shape[-1] * native.group_size)
        return int(native.weight.shape[-1])

    def logits(self, x: mx.array) -> mx.array:
        return x @ self.native.weight.T if self.inline else self.native(x)

    def __call__(self, x: mx.array):
        if self.hands_to is not None:
            self.hands_to.x = x
        (predicted, fallback), native = self.pending, self.logits(x)
        self.call = TapCall(recorded=native)  # lazy: computed only if used
        if predicted is None:
            return self.native(x) if self.inline else native
        if not fallback:  # the same as the `where` below on rows without NaN
            logits = predicted.reshape(*x.shape[:-1], predicted.shape[-1]).astype(native.dtype)
        else:
            predicted = predicted.reshape(*x.shape[:-1], predicted.shape[-1])  # OLMoE flattens
            logits = mx.where(mx.isnan(predicted), native, predicted.astype(native.dtype))
        return self._route(logits) if self.inline else logits

    def _route(self, logits: mx.array):
        """The inline router's own code on `logits`: its weight briefly the identity."""
        router, weight = self.native, self.native.weight
        router.weight = mx.eye(weight.shape[0], dtype=weight.dtype)
        try:
            return router(logits)
        finally:
            router.weight = weight


def _linear_map(block: nn.Module) -> Tuple[nn.Module, str, bool]:
    """(owner, attribute, inline) of the module computing `block`'s router logits."""
    name = router_name(block)
    router = block[name]
    if isinstance(router, RouterTap):
        return block, name, router.inline
    if isinstance(router, _LINEAR):
        return block, name, False
    linears = {n: c for n, c in router.children().items() if isinstance(c, (*_LINEAR, RouterTap))}
    if len(linears) == 1:
        (child, _), = linears.items()
        return router, child, False
    if "weight" in router and isinstance(router["weight"], mx.array):
        return block, name, True
    raise UnsupportedModelError(
        f"{type(router).__name__}: cannot find the linear map computing its router logits "
        f"(one Linear inside it, or its own `weight`; found {sorted(linears) or 'none'})")


def install_tap(block: nn.Module) -> RouterTap:
    """Put a RouterTap in place of `block`'s router map, for good (prerouted modes)."""
    owner, name, inline = _linear_map(block)
    if not isinstance(owner[name], RouterTap):
        setattr(owner, name, RouterTap(owner[name], inline))
    return owner[name]


@contextlib.contextmanager
def tapped(block: nn.Module):
    """A RouterTap in place of the block's router map for the duration, keeping the
    prediction a permanent tap has pending."""
    owner, name, inline = _linear_map(block)
    native = owner[name]
    if isinstance(native, RouterTap):
        pending = native.pending
        try:
            yield native
        finally:
            native.call.pending = pending
        return
    tap = RouterTap(native, inline)
    setattr(owner, name, tap)
    try:
        yield tap
    finally:
        setattr(owner, name, native)


class InputTap(nn.Module):
    """Stands in for the module a whole decoder layer calls first with its input (its
    input norm) and hands that input to `hands_to`."""

    def __init__(self, native: nn.Module, hands_to: BlockInput):
        super().__init__()
        self.native, self.hands_to = native, hands_to

    def __call__(self, x: mx.array, *args, **kwargs):
        self.hands_to.x = x
        return self.native(x, *args, **kwargs)


def hand_input(block: nn.Module, to: BlockInput):
    """From now on each input of the MoE block lands in `to` as the block runs.

    Predictors learn from the block's input (edgemoe.train_prerouter records it); what its
    experts receive can differ (llama4 scales it by the router score, kimi_k3 projects it
    to a latent, some blocks flatten it). The block's router map sees it first, in a
    RouterTap; a block that is a whole decoder layer (gemma4's: its router sees a later
    hidden state) is given it by its input norm, in an InputTap.
    """
    if "input_layernorm" in block:
        if isinstance(block.input_layernorm, InputTap):
            block.input_layernorm.hands_to = to
        else:
            block.input_layernorm = InputTap(block.input_layernorm, to)
    else:
        install_tap(block).hands_to = to


@contextlib.contextmanager
def handing(block: nn.Module, to: BlockInput):
    """`hand_input` for the duration; then the block is as it was."""
    if "input_layernorm" in block:
        norm = block.input_layernorm
        block.input_layernorm = InputTap(norm, to)
        try:
            yield to
        finally:
            block.input_layernorm = norm
        return
    with tapped(block) as tap:
        before, tap.hands_to = tap.hands_to, to
        try:
            yield to
        finally:
            tap.hands_to = before


def gate_logits(block: nn.Module, x: mx.array) -> mx.array:
    """The logits the block's router computes when given `x` (the block's input, for every
    block but one that is a whole decoder layer, gemma4's: its router sees a later hidden
    state, which `tapped(block).recorded` holds after a native call)."""
    owner = _linear_map(block)[0]
    with tapped(block) as tap:
        if owner is block:
            return tap.logits(x)
        block[router_name(block)](x)  # the router's own code feeds the tap its input
        return tap.recorded


def indices_from_logits(block: nn.Module, logits: mx.array) -> mx.array:
    """The expert ids (..., k) that `block`'s own code routes to, given router logits
    (..., E): native logits give the native ids, in the same order."""
    with tapped(block) as tap:
        tap.set_prediction(logits, fallback=False)
        # one batch of all the rows: every block takes (B, L, D); some flatten it themselves
        x = mx.zeros((1, logits.size // logits.shape[-1], tap.input_width), dtype=logits.dtype)
        indices = routed_indices(block, x)
    return indices.reshape(*logits.shape[:-1], indices.shape[-1])


def hidden_size(block: nn.Module) -> int:
    """The width of a MoE block's input (its experts may compute in a narrower latent)."""
    with tapped(block) as tap:
        return tap.input_width


def num_experts(block: nn.Module) -> int:
    """The width of the block's router logits."""
    with tapped(block) as tap:
        return tap.num_experts


def top_k(block: nn.Module) -> int:
    """Experts per token, as the block's own code routes."""
    return int(indices_from_logits(block, mx.zeros((1, num_experts(block)))).shape[-1])


def uses_sigmoid(block: nn.Module) -> bool:
    """True where the router scores experts independently (sigmoid), not by a softmax over
    them: a softmax's routing is the same for logits shifted by a constant."""
    logits = mx.random.normal((64, num_experts(block)), key=mx.random.key(0))
    same = indices_from_logits(block, logits), indices_from_logits(block, logits + 8.0)
    return not mx.array_equal(mx.sort(same[0], -1), mx.sort(same[1], -1)).item()


def multi_hot(indices: mx.array, n: int) -> mx.array:
    """(..., k) expert ids -> (..., n) float32 with ones at those ids (on the device)."""
    return (indices[..., None] == _expert_ids(n)).any(axis=-2).astype(mx.float32)


@functools.lru_cache(maxsize=None)
def _expert_ids(n: int) -> mx.array:
    """0 .. n-1, made once: a compiled head takes it as a constant, not an op per call."""
    ids = mx.arange(n)
    mx.eval(ids)
    return ids
