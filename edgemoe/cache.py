"""Which resident expert a layer's slot pool gives up when it needs room."""

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
