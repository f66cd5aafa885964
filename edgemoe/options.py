"""The streaming options every tool takes, with one set of flags.

    options = StreamOptions.from_args(args)       # after StreamOptions.add_arguments(parser)
    model, tokenizer = edgemoe.load(path, options)
    model, tokenizer = edgemoe.load(path, expert_budget=0.25, routing="prerouted")

`edgemoe.load` (MLX) and `edgemoe.cuda.load` take the same options, as one StreamOptions
and/or keyword overrides of its fields (`StreamOptions.of`). `add_arguments` gives
`generate`, `server`, `eval`, `train_prerouter`, `train_lora`, `doctor` and the benchmarks
the same flags with the same help and defaults; a tool names the ones it takes with `only=`.
"""

import argparse
from dataclasses import dataclass, field, fields, replace
from typing import Optional, Sequence

from .machines import machine_defaults
from .routing.modes import MODE_NAMES, RoutingMode, parse_routing, routing_mode
from .streaming.budget import Budget
from .streaming.cache import DEFAULT_POLICY, POLICIES

IO_MODES = ("buffered", "direct")
PREFILL_ARITHMETIC = ("native", "blas")  # edgemoe.mlx_backend.prefill
DEFAULT_TIMEOUT_S = 60.0  # --group-timeout: a collective waiting longer means a host is gone
# what --help offers first; the other values are accepted, and named in the help's
# "experimental" group (docs/benchmarks.md, "Variants")
MAIN_POLICIES = (DEFAULT_POLICY,)
EXPERIMENTAL_VALUES = {
    "cache_policy": "--cache-policy learned: evict the expert a small model predicts will "
                    "be needed farthest ahead (the pack's cache_policy.npz; "
                    "edgemoe.whatif.experimental); within a point of lfu on the bundled "
                    "model (docs/cache.md).",
}


def number(kind, lo, hi=None, above=False):
    """An argparse type: a finite `kind` at least `lo` (above it, with `above`), at most
    `hi`; anything else, NaN and infinities included, is one usage error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        low_ok = value > lo if above else value >= lo  # False for NaN
        if not low_ok or (hi is not None and not value <= hi):
            bounds = (f"in [{lo}, {hi}]" if hi is not None else
                      f"above {lo}" if above else f"at least {lo}")
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {text}")
        if value in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


@dataclass
class StreamOptions:
    """How a model streams its experts: what `edgemoe.load` and `edgemoe.cuda.load` take,
    whole or as keyword overrides of these fields. `routing` is a RoutingMode (its name is
    accepted and turned into it)."""

    # io, readers, cache_policy and routing default to this machine's (edgemoe.machines)
    expert_budget: Budget = "auto"  # a fraction, a percentage, a size, or auto: what fits
    cache_policy: str = field(default_factory=lambda: machine_defaults().cache_policy)
    io: str = field(default_factory=lambda: machine_defaults().io)
    routing: RoutingMode = field(default_factory=lambda: machine_defaults().routing)
    prerouter_path: Optional[str] = None  # heads folder, or "pack"
    adapter_path: Optional[str] = None  # adapter folder, or "pack"
    readers: int = field(default_factory=lambda: machine_defaults().readers)
    read_timeout: float = 30.0  # seconds a compute may wait for one read
    verify: bool = True  # checksums must be present, and are checked
    distributed: bool = False  # one host of the group mlx.launch started
    partition: Optional[str] = None  # a routing trace the experts are shared out by
    group_timeout: float = DEFAULT_TIMEOUT_S  # seconds a host may keep the others waiting
    prefill_arithmetic: str = "native"  # "blas": prefill's experts through numpy (inexact)
    # each token routes to its k most likely experts (reduced top-k, inexact); None: the
    # model's own k (docs/routing.md, "Experts per token")
    experts_per_token: Optional[int] = None

    def __post_init__(self):
        self.routing = routing_mode(self.routing)  # "prerouted" -> PREROUTED
        if self.prefill_arithmetic not in PREFILL_ARITHMETIC:
            raise ValueError(f"prefill_arithmetic: expected one of "
                             f"{', '.join(PREFILL_ARITHMETIC)}, found {self.prefill_arithmetic!r}")
        k = self.experts_per_token
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise ValueError(f"experts_per_token: expected an integer of at least 1 (or None: "
                             f"the model's own), found {k!r}")

    @classmethod
    def of(cls, options: Optional["StreamOptions"] = None, **overrides) -> "StreamOptions":
        """`options` (default: the defaults) with `overrides` of its fields: the options
        of a `load(path, options, **overrides)` call. An unknown name is a TypeError."""
        if options is not None and not isinstance(options, cls):
            raise TypeError(f"load(path, options): options is a StreamOptions, not "
                            f"{options!r}; name the others (expert_budget={options!r})")
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise TypeError(f"load() got unexpected keyword arguments: "
                            f"{', '.join(sorted(unknown))} (StreamOptions' fields and the "
                            f"backend's own are taken)")
        return (options or cls()).replace(**overrides)

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides) -> "StreamOptions":
        """The options a parsed command line gives (flags it lacks keep their defaults)."""
        given = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**given, **overrides})

    def replace(self, **changes) -> "StreamOptions":
        return replace(self, **changes)

    GROUP = ("distributed", "partition", "group_timeout")  # generate and server only

    @classmethod
    def single_host(cls) -> list:
        """The flags of a tool that runs on one host."""
        return [f.name for f in fields(cls) if f.name not in cls.GROUP]

    @staticmethod
    def add_arguments(parser: argparse.ArgumentParser,
                      only: Optional[Sequence[str]] = None) -> argparse.ArgumentParser:
        """Add the flags (all, or those named in `only` by field name) to `parser`."""
        wanted = set(only) if only is not None else {f.name for f in fields(StreamOptions)}
        unknown = wanted - {f.name for f in fields(StreamOptions)}
        assert not unknown, unknown
        group = parser.add_argument_group("streaming")
        machine = machine_defaults()
        flags = {
            "expert_budget": (("--expert-budget",), dict(
                default="auto", help="Memory for routed experts: a fraction (0.25), a "
                                     "percentage (25%%), a size (2GB), or auto: what fits in "
                                     "the memory available, beside the resident weights and "
                                     "a 4096-token KV cache (default: %(default)s)")),
            "cache_policy": (("--cache-policy",), dict(
                default=machine.cache_policy, choices=sorted(POLICIES),
                metavar="{" + ",".join(MAIN_POLICIES) + "}",
                help="Which resident expert to evict when a layer's slots are full: lfu, the "
                     "one used least often (default: %(default)s; experimental: see below)")),
            "io": (("--io",), dict(
                default=machine.io, choices=IO_MODES,
                help="direct: O_DIRECT reads (F_NOCACHE on macOS) that bypass the page cache "
                     "(default: %(default)s, this machine's: docs/mac.md)")),
            "routing": (("--routing",), dict(
                default=routing_mode(machine.routing), type=parse_routing,
                metavar="{" + ",".join(MODE_NAMES) + "}",
                help="native: the router decides, experts load on demand (exact); advisory: "
                     "later layers' experts are prefetched, same output; prerouted: the "
                     "prerouter heads' prediction is the routing, read a token ahead "
                     "(default: %(default)s)")),
            "prerouter_path": (("--prerouter",), dict(
                dest="prerouter_path", default=None,
                help="Prerouter heads folder (edgemoe.train_prerouter --out DIR: "
                     "DIR/prerouter), or 'pack' for the heads the model folder carries; "
                     "--routing prerouted uses those by default")),
            "adapter_path": (("--adapter-path",), dict(
                default=None,
                help="A LoRA adapter folder (mlx-lm's format), or 'pack' for the adapter the "
                     "model folder carries (PACK/adapter); deltas of the routed experts "
                     "stream with them. Default: the one the prerouter heads carry, if "
                     "any; 'none': no adapter")),
            "readers": (("--readers",), dict(
                type=number(int, 1), default=machine.readers,
                help="Reader threads filling expert slots (default: %(default)s, this "
                     "machine's: docs/mac.md)")),
            "read_timeout": (("--read-timeout",), dict(
                type=number(float, 0, above=True), default=30.0, metavar="SECONDS",
                help="A read that keeps compute waiting longer fails the request with a "
                     "clear error (default: %(default)s)")),
            "verify": (("--no-verify",), dict(
                dest="verify", action="store_false",
                help="Read a pack whose checksums are missing, and skip checking its "
                     "resident weights at load (expert records with a checksum are still "
                     "checked as they are read)")),
            "distributed": (("--distributed",), dict(
                action="store_true",
                help="Run as one host of the group mlx.launch started: this host holds and "
                     "reads only its share of the experts (a shard pack's, or as "
                     "--partition deals them), and the hosts' outputs are summed at every "
                     "MoE layer")),
            "partition": (("--partition",), dict(
                default=None, metavar="TRACE",
                help="With --distributed: share the experts out by the routing in this "
                     "trace (edgemoe.generate --trace), so hosts do equal work (default: "
                     "round-robin, or the share a shard pack carries)")),
            "group_timeout": (("--group-timeout",), dict(
                type=number(float, 0, above=True), default=DEFAULT_TIMEOUT_S,
                metavar="SECONDS",
                help="With --distributed: a host that keeps the others waiting this long is "
                     "taken as gone, and every host stops with an error naming it (default: "
                     "%(default)s)")),
            "prefill_arithmetic": (("--prefill-arithmetic",), dict(
                default="native", choices=PREFILL_ARITHMETIC,
                help="native: mlx-lm's arithmetic, bit-identical (default); blas: on a CPU, "
                     "a long prompt's routed experts are dequantized once and multiplied "
                     "through numpy's BLAS, several times faster, within a stated tolerance "
                     "of mlx-lm's logits, not bit-identical (the MLX backend; "
                     "docs/benchmarks.md, Prefill)")),
            "experts_per_token": (("--experts-per-token",), dict(
                type=number(int, 1), default=None, metavar="K",
                help="Route each token to its K most likely experts, in any --routing mode "
                     "(reduced top-k, as llama.cpp's --override-kv "
                     "<arch>.expert_used_count=int:K): fewer experts read and computed, "
                     "not exact; at most the model's own (default: the model's own, "
                     "exact; docs/routing.md)")),
        }
        for name, (names, kwargs) in flags.items():
            if name in wanted:
                group.add_argument(*names, **kwargs)
        notes = [note for name, note in EXPERIMENTAL_VALUES.items() if name in wanted]
        if notes:
            experimental_group(parser, " ".join(notes))
        return parser


EXPERIMENTAL_TITLE = "experimental"


def experimental_group(parser: argparse.ArgumentParser, description: str = None):
    """The parser's "experimental" argument group (made once); `description` is added to
    what it says."""
    for group in parser._action_groups:
        if group.title == EXPERIMENTAL_TITLE:
            if description:
                group.description = " ".join(filter(None, [group.description, description]))
            return group
    return parser.add_argument_group(
        EXPERIMENTAL_TITLE, "Research variants, kept but not the default: measured no better "
                            "than it on the bundled model (docs/benchmarks.md)."
                            + (" " + description if description else ""))
