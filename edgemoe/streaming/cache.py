"""Which resident expert a layer's slot pool gives up when it needs room.

A policy is told of every use (`touch`) and every eviction (`forget`) in its layer, and
names a `victim` that is not pinned. The store touches every expert a step needs, hits
and misses alike, before it loads the misses (and again as each fill starts); so an
expert touched and not forgotten is resident or about to be loaded. A policy cannot
tell the two apart: `pinned` must hold every expert the current step needs, loaded or
not. Policies that need a clock count touches.

A policy that can rank an expert it does not hold has `heat(expert)`: higher is kept
longer, comparable across one layer's experts, resident or not. An advisory prefetch
evicts only an expert colder than its prediction (`edgemoe.streaming.prefetch`).

A policy is made by name from `POLICIES`: a factory given the model's folder, where a
policy finds what was trained for it. LFU is the policy; another registers itself
(`register_policy`): the learned one, experimental, from edgemoe.whatif.experimental,
which the tools' command line imports (edgemoe.cli) and this runtime never does.
LRU, LFU-DA and S3-FIFO were removed in #44: each was below LFU at every budget on both
bundled models (docs/benchmarks.md, "Variants"). Belady's optimum needs the future; it
lives in `edgemoe.whatif.replay`, which replays recorded routing traces through these
policies and measures them against it.
"""

from collections import OrderedDict
from pathlib import Path
from typing import Callable, Iterable, Optional


class Recency:
    """The residents by last use: the order LFU breaks its ties by, and a replay's plain
    eviction order (the learned policy is fitted to replays that evict by it)."""

    def __init__(self):
        self._order = OrderedDict()  # expert -> None, oldest first
        self._clock = 0
        self._last = {}  # expert -> its last touch, kept after eviction

    def touch(self, expert: int):
        self._order[expert] = None
        self._order.move_to_end(expert)
        self._clock += 1
        self._last[expert] = self._clock

    def forget(self, expert: int):
        self._order.pop(expert, None)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        """The expert used longest ago, never one of `pinned` (the current step's)."""
        pinned = set(pinned)
        return next((e for e in self._order if e not in pinned), None)

    def victim_among(self, candidates) -> Optional[int]:
        """`victim` given the experts it may choose (every resident one not pinned), which
        the store knows: the same choice without a list of every other expert."""
        return next((e for e in self._order if e in candidates), None)

    def rank(self, candidates) -> list:
        """`candidates` (resident experts) in the order `victim_among` would give them up
        one after another (the first first), none touched meanwhile."""
        return sorted(candidates, key=self._last.__getitem__)


class LFUPolicy:
    """Evict the expert used least often since the start; ties go to the least recent.

    Counts survive eviction: a layer has few experts, and an expert's popularity is a
    property of the model more than of the moment. Both are one integer per expert, its
    rank as a victim (`_key`: uses, then last touch; the uses are its bits from 40 up), so
    a touch reads and writes one dict: it runs for every expert of every call (a second
    dict of the uses alone cost a decode call's claim ~1 us more: docs/benchmarks.md,
    session 36).
    """

    def __init__(self):
        self._clock = 0
        self._key = {}  # expert -> its rank as a victim: uses, then last touch, in one int
        self._held = set()  # touched and not forgotten: resident, or about to be loaded

    def touch(self, expert: int):
        self.touch_all((expert,))

    def touch_all(self, experts):
        """`touch` each of `experts` in turn (a call's: its locals looked up once)."""
        key, clock = self._key, self._clock
        for expert in experts:
            clock += 1
            key[expert] = ((key.get(expert, 0) >> 40) + 1) << 40 | clock  # (clock < 2**40)
        self._clock = clock
        self._held.update(experts)

    def forget(self, expert: int):
        self._held.discard(expert)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        return self.victim_among(self._held.difference(pinned))

    def victim_among(self, candidates) -> Optional[int]:
        return min(candidates, key=self._key.__getitem__, default=None)

    def rank(self, candidates) -> list:
        return sorted(candidates, key=self._key.__getitem__)

    def heat(self, expert: int) -> int:
        return self._key.get(expert, 0)  # (uses, then last touch: as `_key` orders them)


# name -> a fresh policy, given the model's folder (None: none, or a replay's)
POLICIES = {"lfu": lambda folder: LFUPolicy()}
DEFAULT_POLICY = "lfu"  # best online policy in cache_sim replays of the bundled model


def register_policy(name: str, factory: Callable[[Optional[Path]], object]):
    """Offer a policy by name (`--cache-policy NAME`): `factory(model folder)` makes one."""
    POLICIES[name] = factory


def make_policy(name, folder: Optional[Path] = None):
    """A fresh policy by name, for the model in `folder`, or from a factory: a callable
    taking nothing."""
    if callable(name):
        return name()
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: choose one of {', '.join(POLICIES)} (an "
                         f"experimental one is offered once edgemoe.whatif.experimental "
                         f"is imported, as the command-line tools do)")
    return POLICIES[name](folder)
