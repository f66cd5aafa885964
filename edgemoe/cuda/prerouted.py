"""Prerouted routing on the CUDA backend: the prerouter heads' prediction is the routing.

The MLX path's semantics (edgemoe.routing.predictors.PreroutedPredictor, .modes, .state),
in PyTorch, with the heads read from their folder (prerouter.safetensors +
prerouter_config.json, as edgemoe.routing.prerouter saves them) without MLX:

- At MoE layer l, a call of L tokens: the head of each target t whose source is l reads
  the block's input and l's routing at every position p and p-1 (the previous call's last
  token's routing for p = 0; none at a sequence's start), and gives t's router logits
  for position p+1.
- Position p of target t routes by the head output of position p-1; position 0 by the
  prediction carried from the sequence's previous call (none at its start: native). The
  call's last prediction is carried to the next call, and its experts are prefetched
  (`store.prefetch(t, experts, 1)`, ungated) as soon as layer l's own experts are in
  slots, so they are read a whole token ahead.
- The heads' config's native_layers (the first MoE layer) keep the native router.
- "prerouted-set": the native router confined to the predicted experts (they are picked,
  and weighed, by the native logits).

The routing is the family's own code: each router's output is replaced (a forward hook)
by the router's own module run on the chosen logits through an identity map, as
edgemoe.routing.gates does for the MLX blocks. The routing state of a sequence lives
beside its KV cache (keyed by the cache object, as edgemoe.routing.state does with
mlx-lm's cache), so two decodes never see each other's predictions; a forward call with
no cache is a whole sequence.
"""

import copy
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from ..format.families import UnsupportedModelError
from ..format.source import pack_asset, resolve_asset
from ..streaming.store import ExpertStore

MODES = ("prerouted", "prerouted-set")
WEIGHTS, CONFIG = "prerouter.safetensors", "prerouter_config.json"  # edgemoe.routing.prerouter
NORM_EPS = 1e-5  # mlx.nn.RMSNorm's default, which the heads were trained with
LEAD = 1  # next-token heads: a prediction is about the layer's next call


@dataclass
class HeadsConfig:
    """prerouter_config.json (edgemoe.routing.prerouter.PrerouterConfig), read as JSON."""

    hidden_size: int
    num_experts: int
    sources: Dict[int, int]  # target MoE layer -> the MoE layer its head runs at
    head_hidden: int = 256
    same_token: bool = False
    native_layers: List[int] = field(default_factory=list)

    @classmethod
    def from_json(cls, d: dict) -> "HeadsConfig":
        return cls(int(d["hidden_size"]), int(d["num_experts"]),
                   {int(t): int(s) for t, s in d["sources"].items()},
                   int(d.get("head_hidden", 256)), bool(d.get("same_token", False)),
                   [int(n) for n in d.get("native_layers", [])])

    @property
    def predicted_layers(self) -> List[int]:
        return sorted(t for t in self.sources if t not in self.native_layers)


class Head(nn.Module):
    """[rms_norm(x), routing at t, routing at t-1] -> the target's router logits (the MLX
    PrerouterHead, parameter for parameter)."""

    def __init__(self, hidden_size: int, num_experts: int, head_hidden: int):
        super().__init__()
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.up = nn.Linear(hidden_size + 2 * num_experts, head_hidden)
        self.down = nn.Linear(head_hidden, num_experts)

    def forward(self, x, now, prev):
        x = x.float()
        h = torch.cat([F.rms_norm(x, x.shape[-1:], self.norm.weight, NORM_EPS), now, prev], -1)
        return self.down(F.silu(self.up(h)))


class Heads(nn.Module):
    """All heads of one model (`heads.layer_<target>`), in float32."""

    def __init__(self, config: HeadsConfig):
        super().__init__()
        self.config = config
        self.heads = nn.ModuleDict({f"layer_{t}": Head(config.hidden_size, config.num_experts,
                                                       config.head_hidden)
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


def heads_folder(model: Path, routing: str, given) -> Optional[Path]:
    """The prerouter folder a prerouted mode uses: `given`, "pack" or None for the one
    the pack carries (as the MLX loader resolves it)."""
    if routing not in MODES:
        if given is not None and routing == "advisory":  # the MLX path's heads-advisory
            raise ValueError(f"prerouter={given}: the CUDA backend's advisory routing uses "
                             f"the next layer's router; the heads serve {' or '.join(MODES)}")
        return None
    heads = resolve_asset(given, model, "prerouter", "--prerouter")
    if heads is None:
        heads = pack_asset(model, "prerouter")
    if heads is None:
        raise ValueError(f"--routing {routing} needs prerouter heads: pass prerouter=DIR; "
                         f"{model} carries none (python -m edgemoe.train_prerouter makes them)")
    return heads


def load_heads(path, device) -> Heads:
    path = Path(path)
    for name in (CONFIG, WEIGHTS):
        if not (path / name).exists():
            raise FileNotFoundError(f"{path / name}: no such file; is {path} a prerouter "
                                    f"folder (python -m edgemoe.train_prerouter --out ...)?")
    config = HeadsConfig.from_json(json.loads((path / CONFIG).read_text()))
    if config.same_token:
        raise ValueError(f"{path / CONFIG}: same_token heads; prerouted routing needs "
                         f"next-token heads (trained without --same-token)")
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
    pending: Dict[int, tuple] = field(default_factory=dict)  # target -> its routing now
    ahead: Dict[int, Dict[int, torch.Tensor]] = field(default_factory=dict)  # prefetches


class PreroutedRouting:
    """Runs the heads at each MoE layer of the model's forward calls and routes the
    predicted layers by them."""

    def __init__(self, heads: Heads, routers: Dict[int, nn.Module], store: ExpertStore,
                 confine: bool = False):
        self.heads, self.store, self.confine = heads, store, confine
        config = heads.config
        missing = sorted((set(config.sources) | set(config.sources.values())) - set(routers))
        if missing:
            raise ValueError(f"prerouter heads for MoE layers {missing}: the model's MoE "
                             f"layers are {sorted(routers)}")
        self.targets_of: Dict[int, List[int]] = {}
        for target, source in sorted(config.sources.items()):
            self.targets_of.setdefault(source, []).append(target)
        self.predicted = set(config.predicted_layers)
        self.logit_routers = {t: LogitRouter(routers[t]) for t in config.sources}
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

    def routed(self, layer: int, x: torch.Tensor, output):
        """Layer `layer`'s router gave `output` for its input `x` (tokens, D): replace it by
        the predicted routing where there is one, and run the heads this layer sources."""
        if not self.calls:  # a block called outside a model call: native, unrecorded
            return None
        call = self.calls[-1]
        pending = call.pending.pop(layer, None)
        if pending is not None:
            output = self._predicted_routing(layer, output[0], *pending)
        self._run_heads(call, layer, x, output[2])
        return output

    def prefetch(self, layer: int):
        """Layer `layer`'s experts are in slots: read the experts its heads predicted."""
        if not self.calls:
            return
        for target, experts in self.calls[-1].ahead.pop(layer, {}).items():
            self.store.prefetch(target, experts.reshape(-1).cpu().numpy(), LEAD)

    def _predicted_routing(self, layer: int, native: torch.Tensor, kind: str, value):
        if kind == "logits":  # rows of NaN: no prediction (a sequence's first token)
            value = value.reshape(native.shape)
            logits = torch.where(torch.isnan(value), native, value.to(native.dtype))
        else:  # "allowed": the native logits confined to predicted ids; -1: none
            allowed = value.reshape(native.shape[0], -1)
            inside = (allowed[..., None] == torch.arange(native.shape[-1],
                                                         device=native.device)).any(-2)
            # the lowest finite value, not -inf: the identity map would make -inf NaN
            low = torch.full_like(native, torch.finfo(native.dtype).min)
            logits = torch.where(allowed[:, :1] < 0, native, torch.where(inside, native, low))
        return self.logit_routers[layer](logits)

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
            logits = self.heads.logits(target, x, now, prev)  # (rows, L, E): position p+1
            route = self.logit_routers[target]
            ahead[target] = route(logits[:, -1])[2]
            if target not in self.predicted:
                continue
            first = state.carry.get(target)
            if first is None or first.shape[0] != rows:
                first = torch.full_like(logits[:, :1], float("nan"))
            shifted = torch.cat([first, logits[:, :-1]], 1)
            state.carry[target] = logits[:, -1:]
            if self.confine:  # the predicted set; -1 where there is no prediction
                allowed = route(torch.nan_to_num(shifted, nan=0.0))[2].long()
                call.pending[target] = ("allowed", torch.where(
                    torch.isnan(shifted[..., :1]), -1, allowed))
            else:
                call.pending[target] = ("logits", shifted)
        if ahead:
            call.ahead[layer] = ahead


def returned_cache(output):
    """The cache a forward call returned (`cache`, `past_key_values` before transformers
    5.2x; looked up by key: the old name's property warns)."""
    names = list(output.keys()) if isinstance(output, dict) else []
    name = next((n for n in ("cache", "past_key_values") if n in names), None)
    return None if name is None else output[name]


class LogitRouter:
    """A router's own module run on router logits: its map the identity (x @ I.T is x,
    exactly), so the family's routing math (softmax, top-k, renormalisation) applies to
    logits it did not compute. Checked against the router itself on random inputs."""

    def __init__(self, router: nn.Module):
        weight = getattr(router, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2 \
                or not hasattr(router, "hidden_dim"):
            raise UnsupportedModelError(
                f"{type(router).__name__}: prerouted routing runs routers with a (experts, "
                f"hidden) `weight` and a `hidden_dim` (transformers 5's TopKRouter)")
        experts, width = weight.shape
        self.twin = copy.deepcopy(router)
        self.twin.weight = nn.Parameter(torch.eye(experts, dtype=weight.dtype,
                                                  device=weight.device), requires_grad=False)
        self.twin.hidden_dim = experts
        self.dtype = weight.dtype
        gen = torch.Generator(device=weight.device).manual_seed(0)
        x = torch.randn(16, width, generator=gen, device=weight.device).to(weight.dtype)
        with torch.no_grad():
            native = router(x)
            mine = self(native[0])
        if not (torch.equal(native[2], mine[2]) and torch.equal(native[1], mine[1])):
            raise UnsupportedModelError(f"{type(router).__name__}: its routing of its own "
                                        f"logits differs from its routing of its input")

    def __call__(self, logits: torch.Tensor):
        """(logits, scores, indices) of (..., E) logits, by the router's own code (its
        forward, not its __call__: no hooks)."""
        shape = logits.shape[:-1]
        out = self.twin.forward(logits.reshape(-1, logits.shape[-1]).to(self.dtype))
        return tuple(o.reshape(*shape, o.shape[-1]) for o in out)


def install(model: nn.Module, store: ExpertStore, heads: Heads, confine: bool = False):
    """Route `model`'s MoE layers by the heads (the model's MoE blocks are those `store`
    streams; their `experts` are edgemoe.cuda.experts.StreamingExperts)."""
    layers = model.model.layers
    blocks = {index: layers[index].mlp for index in store.layer_indices}
    config = heads.config
    width = blocks[min(blocks)].gate.weight.shape
    if (config.num_experts, config.hidden_size) != tuple(width):
        raise ValueError(f"prerouter heads for {config.num_experts} experts of width "
                         f"{config.hidden_size}; the model's routers are {tuple(width)}")
    routing = PreroutedRouting(heads, {i: b.gate for i, b in blocks.items()}, store, confine)
    for index, block in blocks.items():
        block.gate.register_forward_hook(
            lambda module, args, output, index=index: routing.routed(index, args[0], output))
        block.experts.advise = lambda x, index=index: routing.prefetch(index)
    model.register_forward_pre_hook(routing.enter, with_kwargs=True)
    model.register_forward_hook(routing.exit, with_kwargs=True, always_call=True)
    store.gate_prefetches(False)  # the prediction is the routing: always read it ahead
    return routing
