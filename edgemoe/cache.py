"""Which resident expert a layer's slot pool gives up when it needs room.

A policy is told of every use (`touch`) and every eviction (`forget`) in its layer, and
names a `victim` that is not pinned (the experts the current step needs).
"""

from collections import OrderedDict
from typing import Iterable, Optional


class LRUPolicy:
    """Evict the expert used longest ago."""

    def __init__(self):
        self._order = OrderedDict()  # expert -> None, oldest first

    def touch(self, expert: int):
        self._order[expert] = None
        self._order.move_to_end(expert)

    def forget(self, expert: int):
        self._order.pop(expert, None)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        """The expert to evict, never one of `pinned` (those the current step uses)."""
        pinned = set(pinned)
        return next((e for e in self._order if e not in pinned), None)


POLICIES = {"lru": LRUPolicy}
DEFAULT_POLICY = "lru"


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()
