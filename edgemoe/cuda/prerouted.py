"""Prerouted routing on the CUDA backend: the prerouter heads' prediction is the routing.

The MLX path's semantics (edgemoe.mlx_backend.predictors.PreroutedPredictor, .modes, .state),
in PyTorch, with the heads read from their folder (prerouter.safetensors +
prerouter_config.json, as edgemoe.mlx_backend.prerouter saves them) without MLX:

- At MoE layer l, a call of L tokens: the head of each target t whose source is l reads
  the MoE block's input (what edgemoe.mlx_backend.gates.hand_input gives the MLX path's heads;
  gemma4's block is its decoder layer) and the experts l routed to at every position p and
  p-1 (the previous call's last token's for p = 0; none at a sequence's start), and
  gives t's router logits for position p+1.
- Position p of target t routes by the head output of position p-1; position 0 by the
  prediction carried from the sequence's previous call (none at its start: native). The
  call's last prediction is carried to the next call, and its experts are prefetched
  (`store.prefetch(t, experts, 1)`, ungated) as soon as layer l's own experts are in
  slots, so they are read a whole token ahead.
- Same-token heads: position p of target t routes by the head output of position p, and
  those experts are read while layer l computes (a layer ahead).
- The heads' config's native_layers (the first MoE layer) keep the native router.

The routing is the family's own code, as edgemoe.mlx_backend.gates makes it for the MLX
blocks: a RouterTap stands in for the linear map that computes a block's router logits
(the router's own `weight`, as transformers 5's TopKRouters hold it, or the one Linear
inside the router: afmoe's `gate`, gemma4's `proj`) and replaces its output by the chosen
logits, so that the router's own code (softmax or sigmoid, score biases, expert groups,
top-k, renormalisation) routes by them. Where the map is the router's own weight, the
router runs on the logits through an identity map (x @ I.T is x, exactly). Every tap is
checked at install: a router that does not route its own logits as it routes its input
is refused in one line (model_type and why). The routing state of a sequence lives
beside its KV cache (keyed by the cache object, as edgemoe.mlx_backend.state does with
mlx-lm's cache), so two decodes never see each other's predictions; a forward call with
no cache is a whole sequence.
"""

import copy
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..format.families import UnsupportedModelError
from ..routing.heads_config import CONFIG, HEAD_HIDDEN, WEIGHTS, PrerouterConfig, read_config
from ..routing.modes import ROUTING_MODES
from ..streaming.store import ExpertStore
from . import families

MODES = tuple(mode.name for mode in ROUTING_MODES if mode.routes)  # these modes' names
NORM_EPS = 1e-5  # mlx.nn.RMSNorm's default, which the heads were trained with


class Head(nn.Module):
    """[rms_norm(x), routing at t, routing at t-1] -> the target's router logits (the MLX
    PrerouterHead, parameter for parameter)."""

    def __init__(self, hidden_size: int, num_experts: int):
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.up = nn.Linear(hidden_size + 2 * num_experts, HEAD_HIDDEN)
        self.down = nn.Linear(HEAD_HIDDEN, num_experts)

    def forward(self, x, now, prev):
        x = x.float()
        h = torch.cat([F.rms_norm(x, x.shape[-1:], self.norm.weight, NORM_EPS), now, prev], -1)
        return self.down(F.silu(self.up(h)))


class Heads(nn.Module):
    """All heads of one model (`heads.layer_<target>`), in float32."""

    def __init__(self, config: PrerouterConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleDict({f"layer_{t}": Head(config.hidden_size, config.num_experts)
                                    for t in sorted(config.sources)})

    def logits(self, target: int, x, routed_now, routed_prev):
        """Target's predicted router logits from its source's input x (..., D) and expert
        ids (..., k) at this token and the previous one (-1: none)."""
        n = self.config.num_experts
        return self.heads[f"layer_{target}"](x, multi_hot(routed_now, n),
                                             multi_hot(routed_prev, n))


def multi_hot(ids: torch.Tensor, n: int) -> torch.Tensor:
    """(..., k) expert ids -> (..., n) float32 ones at those ids (-1 marks none)."""
    return (ids[..., None] == torch.arange(n, device=ids.device)).any(-2).float()


def load_heads(path, device) -> Heads:
    """The heads of a prerouter folder on `device`."""
    path = Path(path)
    config = read_config(path)
    if not config.plain:
        raise ValueError(f"{path / CONFIG}: route_top_k {config.route_top_k}, conditional "
                         f"{config.conditional}: the MLX backend's modes; this backend "
                         f"routes by plain heads (both 0): `python -m "
                         f"edgemoe.routing.between --heads {path} --plain-copy DIR` makes "
                         f"them, for --prerouter DIR")
    heads = Heads(config)
    found = load_file(str(path / WEIGHTS))
    missing, unexpected = heads.load_state_dict(found, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path / WEIGHTS}: expected the heads of {CONFIG}; missing "
                         f"{missing[:3]}, unexpected {unexpected[:3]}")
    return heads.to(device=device, dtype=torch.float32).eval().requires_grad_(False)


class SequenceState:
    """What a sequence carries from one forward call to the next (one row per sequence):
    per MoE layer the last token's expert ids, per predicted layer the logits predicted
    for the next call's first token."""

    def __init__(self):
        self.previous: Dict[int, torch.Tensor] = {}  # layer -> (rows, k) long; -1: none
        self.carry: Dict[int, torch.Tensor] = {}  # layer -> (rows, 1, E) float32; NaN: none


@dataclass
class Call:
    """One forward call: its sequence's state, its rows, and what it has predicted."""

    state: SequenceState
    rows: int
    cache: object
    inputs: Dict[int, torch.Tensor] = field(default_factory=dict)  # MoE layer -> its input
    pending: Dict[int, torch.Tensor] = field(default_factory=dict)  # target -> its logits now
    # prefetches: MoE layer -> {(target, lead): expert ids}
    ahead: Dict[int, Dict[tuple, torch.Tensor]] = field(default_factory=dict)


class PreroutedRouting:
    """Runs the heads at each MoE layer of the model's forward calls and routes the
    predicted layers by them (through each layer's RouterTap)."""

    def __init__(self, heads: Heads, taps: Dict[int, "RouterTap"],
                 store: Optional[ExpertStore]):
        self.heads, self.taps, self.store = heads, taps, store
        config = heads.config
        missing = sorted(set(config.layers) - set(taps))
        if missing:
            raise ValueError(f"prerouter heads for MoE layers {missing}: the model's MoE "
                             f"layers are {sorted(taps)}")
        self.targets_of = config.targets_of
        self.predicted = set(config.predicted_layers)
        self.lead = config.lead  # next-token heads: the layer's next call; same-token: this
        self._states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
        self.calls: List[Call] = []

    # --- the model's forward calls --------------------------------------------------

    def enter(self, module, args, kwargs):
        cache = kwargs.get("past_key_values", kwargs.get("cache"))
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None:
            inputs = kwargs.get("inputs_embeds")
        rows = inputs.shape[0] if inputs is not None and inputs.dim() > 1 else 1
        self.calls.append(Call(self.state_of(cache), rows, cache))

    def exit(self, module, args, kwargs, output):
        for tap in self.taps.values():  # a prediction never outlives its forward call
            tap.prediction = None
        if not self.calls:  # (enter failed)
            return
        call = self.calls.pop()  # its predictions and prefetches end with it
        made = returned_cache(output)
        if call.cache is None and made is not None:  # the call made the sequence's cache
            self._states[made] = call.state

    def state_of(self, cache) -> SequenceState:
        if cache is None:
            return SequenceState()
        state = self._states.get(cache)
        if state is None:
            state = self._states[cache] = SequenceState()
        return state

    # --- each MoE layer ---------------------------------------------------------------

    def entered(self, layer: int, x: torch.Tensor):
        """Layer `layer`'s MoE block is called on `x`: its router is to route by the
        prediction made for this call, if any."""
        if not self.calls:  # a block called outside a model call: native, unrecorded
            return
        call = self.calls[-1]
        call.inputs[layer] = x
        self.taps[layer].prediction = call.pending.pop(layer, None)

    def routed(self, layer: int, ids: torch.Tensor):
        """Layer `layer` routed its tokens to `ids` (tokens, k): run the heads it sources."""
        if not self.calls or layer not in self.calls[-1].inputs:
            return
        call = self.calls[-1]
        self._run_heads(call, layer, call.inputs.pop(layer), ids)

    def prefetch(self, layer: int):
        """Layer `layer`'s experts are in slots: read the experts its heads predicted."""
        if not self.calls or self.store is None:
            return
        for (target, lead), experts in self.calls[-1].ahead.pop(layer, {}).items():
            self.store.prefetch(target, experts.reshape(-1).cpu().numpy(), lead)

    def _run_heads(self, call: Call, layer: int, x: torch.Tensor, ids: torch.Tensor):
        rows, state = call.rows, call.state
        x = x.reshape(rows, -1, x.shape[-1])
        now = ids.reshape(rows, x.shape[1], -1).long()
        last = state.previous.get(layer)
        if last is None or last.shape != (rows, now.shape[-1]):
            last = torch.full((rows, now.shape[-1]), -1, dtype=now.dtype, device=now.device)
        prev = torch.cat([last[:, None], now[:, :-1]], 1)
        state.previous[layer] = now[:, -1]
        ahead = {}
        for target in self.targets_of.get(layer, ()):
            logits = self.heads.logits(target, x, now, prev)  # (rows, L, E)
            tap = self.taps[target]
            # same-token: position p's routing, read now; next-token: position p+1's
            ahead[target, self.lead] = tap.route(logits if self.lead == 0 else logits[:, -1])
            if target in self.predicted:
                call.pending[target] = logits if self.lead == 0 else \
                    _shifted(state, target, logits)
        if ahead:
            call.ahead[layer] = ahead


def _shifted(state: SequenceState, target: int, logits: torch.Tensor) -> torch.Tensor:
    """Next-token logits as the routing of each position: the previous position's
    prediction, the call's first from the sequence's last call (NaN: none)."""
    first = state.carry.get(target)
    if first is None or first.shape[0] != logits.shape[0]:
        first = torch.full_like(logits[:, :1], float("nan"))
    state.carry[target] = logits[:, -1:]
    return torch.cat([first, logits[:, :-1]], 1)


def returned_cache(output):
    """The cache a forward call returned (`cache`, `past_key_values` before transformers
    5.2x; looked up by key: the old name's property warns)."""
    names = list(output.keys()) if isinstance(output, dict) else []
    name = next((n for n in ("cache", "past_key_values") if n in names), None)
    return None if name is None else output[name]


class RouterTap:
    """Stands in for the linear map computing a MoE block's router logits, as the MLX
    path's RouterTap does (edgemoe.mlx_backend.gates): the map's next call returns, once,
    `prediction` instead of its own logits: (..., E), rows of NaN keeping the native ones.
    `route(logits)` is the experts the block's router picks from router logits, by its
    own code."""

    def __init__(self, model_type: str, block: nn.Module):
        self.model_type, self.block = model_type, block
        router = families.router(block)
        self.prediction: Optional[torch.Tensor] = None
        self.recorded: Optional[torch.Tensor] = None  # the logits the map last computed
        weight = getattr(router, "weight", None)
        linears = [m for m in router.children() if isinstance(m, nn.Linear)]
        if isinstance(weight, torch.Tensor) and weight.dim() == 2:  # x @ weight.T inside
            self.map, self.twin = router, identity_twin(router)
        elif len(linears) == 1:
            self.map, self.twin = linears[0], None
        else:
            raise UnsupportedModelError(
                f"model_type {model_type!r}: prerouted routing replaces the linear map of "
                f"each router's logits, and {type(router).__name__} has neither a 2-D "
                f"`weight` nor one Linear inside it (found {len(linears)})")
        self.num_experts, self.input_width = self.map.weight.shape
        self.map.register_forward_hook(self._replace, with_kwargs=True)
        self._check(type(router).__name__)

    def route(self, logits: torch.Tensor) -> torch.Tensor:
        """(..., k) expert ids of (..., E) router logits."""
        return self._routed_by(logits)[-1].reshape(*logits.shape[:-1], -1)

    def _routed_by(self, logits: torch.Tensor) -> tuple:
        """The router's output, called as its block calls it, where its map gives `logits`."""
        flat = logits.reshape(-1, logits.shape[-1])
        kept, self.prediction = self.prediction, flat
        try:
            x = torch.zeros(flat.shape[0], self.input_width, dtype=self.map.weight.dtype,
                            device=flat.device)
            return families.router_output(self.model_type, self.block, x)
        finally:
            self.prediction = kept

    def _replace(self, module, args, kwargs, output):
        native = output if isinstance(output, torch.Tensor) else output[0]
        self.recorded = native
        prediction, self.prediction = self.prediction, None
        if prediction is None:
            return None
        logits = chosen(native, prediction)
        if self.twin is None:
            return logits
        if self.twin.weight.dtype != logits.dtype:  # the identity in the logits' dtype
            self.twin.weight.data = self.twin.weight.data.to(logits.dtype)
        # its forward, not its __call__ (no hooks), given what else the router was (lfm2's
        # expert_bias)
        mine = self.twin.forward(logits, *args[1:], **kwargs)
        if isinstance(output, torch.Tensor):
            return mine.to(output.dtype)
        return tuple(m.to(n.dtype) for m, n in zip(mine, output))

    @torch.no_grad()
    def _check(self, router: str):
        training = self.block.training
        self.block.eval()  # phimoe's sparsemixer samples while training
        try:
            self._check_eval(router)
        finally:
            self.block.train(training)

    def _check_eval(self, router: str):
        gen = torch.Generator(device=self.map.weight.device).manual_seed(0)
        x = torch.randn(16, self.input_width, generator=gen, device=self.map.weight.device)
        native = families.router_output(self.model_type, self.block,
                                        x.to(self.map.weight.dtype))
        mine = self._routed_by(self.recorded)
        if not all(torch.equal(a, b) for a, b in zip(native, mine)):
            raise UnsupportedModelError(
                f"model_type {self.model_type!r}: prerouted routing runs the router on "
                f"given logits, and {router}'s routing of its own logits differs from its "
                f"routing of its input")


def identity_twin(router: nn.Module) -> nn.Module:
    """A copy of a router whose own `weight` is its logits' map, with the identity for it:
    its forward routes the logits it is given."""
    twin = copy.deepcopy(router)
    experts, weight = router.weight.shape[0], router.weight
    twin.weight = nn.Parameter(torch.eye(experts, dtype=weight.dtype, device=weight.device),
                               requires_grad=False)
    if hasattr(twin, "hidden_dim"):  # transformers' TopKRouter: view(-1, hidden_dim)
        twin.hidden_dim = experts
    return twin.eval()  # not the model's module: its train() never reaches the twin


def chosen(native: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """The logits a prediction routes by, in the shape and dtype of the map's `native`
    logits: the predicted ones, rows of NaN keeping the native ones."""
    flat = native.reshape(-1, native.shape[-1])
    predicted = predicted.reshape(flat.shape)
    logits = torch.where(torch.isnan(predicted), flat, predicted.to(flat.dtype))
    return logits.reshape(native.shape)


def install(model: nn.Module, store: Optional[ExpertStore], heads: Heads,
            moe_layers: Sequence[int] = ()):
    """Route `model`'s MoE layers by the heads (the model's MoE blocks are those `store`
    streams; their `experts` are edgemoe.cuda.experts.StreamingExperts). Without a store
    (edgemoe.cuda.train: every expert resident), `moe_layers` are the MoE layers and
    nothing is read ahead."""
    layers = model.model.layers
    indices = store.layer_indices if store is not None else moe_layers
    blocks = {index: families.moe_block(layers[index]) for index in indices}
    taps = {index: RouterTap(model.config.model_type, block) for index, block in blocks.items()}
    config = heads.config
    found = sorted({(tap.num_experts, tap.input_width) for tap in taps.values()})
    if found != [(config.num_experts, config.hidden_size)]:
        raise ValueError(f"prerouter heads for {config.num_experts} experts of width "
                         f"{config.hidden_size}; the model's routers are "
                         f"{', '.join(map(str, found))}")
    routing = PreroutedRouting(heads, taps, store)
    for index, block in blocks.items():
        block.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: routing.entered(
                index, args[0] if args else kwargs["hidden_states"]), with_kwargs=True)
        block.experts.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: routing.routed(
                index, args[1] if len(args) > 1 else kwargs["top_k_index"]), with_kwargs=True)
        block.experts.advise = lambda x, index=index: routing.prefetch(index)
    model.register_forward_pre_hook(routing.enter, with_kwargs=True)
    model.register_forward_hook(routing.exit, with_kwargs=True, always_call=True)
    if store is not None:
        store.gate_prefetches(False)  # the prediction is the routing: always read it ahead
    return routing
