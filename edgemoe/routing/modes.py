"""The routing modes: who decides which experts a token uses, and what that asks for.

    native         the model's own router; experts load on demand
    advisory       a predictor prefetches later layers' experts; the router decides
    prerouted      the prerouter heads' prediction is the routing, read a token ahead

A mode is a `RoutingMode`: the tools ask it what it needs and allows, not its name
(`routing_mode("prerouted").exact` is False). Each backend installs a mode's routing by
asking it the same two questions: `advisory` (the next layer's router prefetches; the
router decides) and `routes` (the heads' prediction is the routing); native is neither.
The names are the --routing values. Any mode may route each token to fewer experts than
the model's own k (`--experts-per-token`: `ExpertsPerToken`, reduced top-k); the routing
is then not exact, and `routing_report` says so. This module imports neither MLX nor
PyTorch.
"""

import argparse
from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class RoutingMode:
    """One routing mode, by what it does."""

    name: str
    predicts: bool  # a predictor runs beside the model (every mode but native)
    routes: bool  # the heads' prediction is the routing: not the native router's own

    def __str__(self) -> str:
        return self.name

    @property
    def exact(self) -> bool:
        """Outputs bit-identical to native routing (the model's router decides)."""
        return not self.routes

    @property
    def needs_heads(self) -> bool:
        """Prerouter heads are required (advisory prefetches by the next layer's router)."""
        return self.routes

    def check_heads(self, given) -> None:
        """Refuse heads given to advisory routing: it prefetches by the next layer's router
        (advisory with the heads was removed in #44: docs/benchmarks.md, "Variants")."""
        if given is not None and self.advisory:
            raise ValueError(f"--prerouter {given}: advisory routing prefetches by the next "
                             f"layer's router; the heads serve --routing prerouted")

    @property
    def advisory(self) -> bool:
        """The prediction is advice: it prefetches, the router decides."""
        return self.predicts and not self.routes

    @property
    def gates_prefetches(self) -> bool:
        """Predictions prefetch only where they prove right: advice, where the prerouted
        modes' prediction is the routing itself, always read ahead."""
        return self.advisory

    @property
    def allows_drafts(self) -> bool:
        """Speculative decoding: rejected drafts would leave a predicted routing of tokens
        that are gone, so only an exact mode takes a draft."""
        return self.exact

    @property
    def allows_prompt_cache(self) -> bool:
        """A cached prefix would need the routing its heads predicted kept with it, so only
        an exact mode reuses one."""
        return self.exact


NATIVE = RoutingMode("native", predicts=False, routes=False)
ADVISORY = RoutingMode("advisory", predicts=True, routes=False)
PREROUTED = RoutingMode("prerouted", predicts=True, routes=True)
ROUTING_MODES = (NATIVE, ADVISORY, PREROUTED)
MODE_NAMES = tuple(mode.name for mode in ROUTING_MODES)


@dataclass(frozen=True)
class ExpertsPerToken:
    """The experts each token routes to (`used`) of the model's own k (`of`)."""

    used: int
    of: int

    @property
    def reduced(self) -> bool:
        return self.used < self.of

    def __str__(self) -> str:
        return f"{self.used} of {self.of}"


def routing_report(mode: "RoutingMode", experts: ExpertsPerToken) -> dict:
    """What a tool reports of a loaded model's routing: its mode, whether its outputs are
    native's (bit-identical to mlx-lm: an exact mode routing to all of the model's k),
    and its experts per token ("4 of 8")."""
    return {"routing": mode.name, "exact": mode.exact and not experts.reduced,
            "experts_per_token": str(experts)}


def describe_routing(mode: "RoutingMode", experts: ExpertsPerToken) -> str:
    """`routing_report` in words: "native, 4 of 8 experts per token (reduced: not exact)"."""
    what = "exact" if routing_report(mode, experts)["exact"] else \
        "reduced: not exact" if experts.reduced else "not exact"
    return f"{mode.name}, {experts} experts per token ({what})"


def routing_mode(mode: Union[str, RoutingMode]) -> RoutingMode:
    """The mode named `mode` (a mode is itself); an unknown name is a ValueError."""
    if isinstance(mode, RoutingMode):
        return mode
    for known in ROUTING_MODES:
        if known.name == mode:
            return known
    raise ValueError(f"--routing {mode!r}: choose one of {', '.join(MODE_NAMES)}")


def parse_routing(text: str) -> RoutingMode:
    """--routing's argparse type: an unknown name is a usage error."""
    try:
        return routing_mode(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid choice: {text!r} (choose from {', '.join(MODE_NAMES)})") from None
