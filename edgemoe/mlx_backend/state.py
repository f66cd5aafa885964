"""Routing state that belongs to a sequence: what predicted routing carries from one
forward call to the next.

The prerouter heads read the routing of the previous token, and the prerouted modes
keep the prediction made at a sequence's last token for its next call. That state
lives beside the sequence's KV cache: `sequence_state(cache)` gives the state of the
sequence (or batch of sequences) a cache belongs to, made on first use, so two
sequences, or a new request after an old one, never see each other's predictions and
nobody has to reset anything. A forward call without a cache is a whole sequence: it
gets a fresh state. Rows are sequences; a batching engine merges, extends and filters
the states of its rows as it does their caches.
"""

import weakref
from typing import Dict, List, Optional

import mlx.core as mx

_states: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class RoutingState:
    """Per MoE layer: the last tokens' expert ids; per predicted layer: the logits
    predicted for the next call's first token. Arrays have one row per sequence."""

    def __init__(self):
        self.rows: Optional[int] = None  # known after the first call
        self.previous: Dict[int, mx.array] = {}  # layer -> (rows, 1, k) int32, the last
        #                                          token's ids; -1: none
        self.carry: Dict[int, mx.array] = {}  # layer -> (rows, 1, E) float; NaN: none
        self.calls = 0  # forward calls begun
        # (layer, the call it routes) -> host expert ids (rows, k): a prediction that is
        # the layer's whole routing of that call, already on the host (no routing sync
        # needed); an optimisation only, so a batch's merge or filter drops it
        self.known: Dict[tuple, object] = {}

    @property
    def size(self) -> int:
        return self.rows or 1  # a sequence that has not run yet is one row

    @classmethod
    def merge(cls, states: List["RoutingState"]) -> "RoutingState":
        """One state whose rows are `states`' rows, in order."""
        merged = cls()
        merged.rows = sum(s.size for s in states)
        for field, fill in (("previous", -1), ("carry", mx.nan)):
            keys = set().union(*(getattr(s, field) for s in states))
            for key in keys:
                like = next(getattr(s, field)[key] for s in states if key in getattr(s, field))
                parts = [getattr(s, field).get(key) for s in states]
                parts = [p if p is not None else
                         mx.full((s.size, *like.shape[1:]), fill, dtype=like.dtype)
                         for p, s in zip(parts, states)]
                getattr(merged, field)[key] = mx.concatenate(parts)
        return merged

    def extend(self, other: "RoutingState"):
        """Append `other`'s rows (in place, as a batch cache's `extend`)."""
        merged = RoutingState.merge([self, other])
        self.rows, self.previous, self.carry = merged.rows, merged.previous, merged.carry
        self.known = {}

    def filter(self, keep: List[int]):
        """Keep only the rows `keep` (in place, as a batch cache's `filter`)."""
        index = mx.array(keep)
        self.previous = {k: v[index] for k, v in self.previous.items()}
        self.carry = {k: v[index] for k, v in self.carry.items()}
        self.rows = len(keep)
        self.known = {}


def sequence_state(cache) -> RoutingState:
    """The state of the sequence `cache` (an mlx-lm prompt cache, a list) belongs to;
    a fresh one for no cache."""
    if not cache:
        return RoutingState()
    state = _states.get(cache[0])
    if state is None:
        state = _states[cache[0]] = RoutingState()
    return state


def bind(cache, state: RoutingState):
    """Make `state` the routing state of `cache` (a batch built from rows' caches)."""
    _states[cache[0]] = state
