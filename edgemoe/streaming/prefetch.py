"""A pool's predictions: a layer's experts read ahead of the call that needs them.

A prediction may `prefetch` a layer's experts ahead of time, for its next call or the one
after. An advisory prediction (`gated`: the router still decides) must earn it: each layer
scores its predictions against what its calls then request, and prefetches only while
enough of them were used (MIN_PRECISION, after TRUST_AFTER calls) and while what its
prefetches wasted stays within WASTE_BUDGET of the bytes it read: a prefetch evicted
unused, or one that evicted an expert a call then had to read again, is waste. Where
reads dominate, a wrong guess costs its bytes and a right one saves little (the read
would have happened anyway), so the budget, not the precision, is what keeps advisory
from losing to on demand. Until a layer trusts its predictions it reads nothing for
them, so a bad predictor costs no bytes and evicts nothing. Even a trusted guess never
evicts what the layer's last call used, nor an expert the policy ranks hotter.
Prefetching is a part of LayerSlots (edgemoe.streaming.slots), which holds the state and
runs the calls. This module needs neither MLX nor PyTorch.
"""

import numpy as np

from .fills import FREE, Room, SlotFills

MIN_PRECISION = 0.5  # of a layer's recent advisory predictions used, to prefetch for it
TRUST_AFTER = 4  # calls whose predictions a layer scores before it may trust them
PRECISION_DECAY = 0.8  # weight of the past in a layer's running precision
WASTE_BUDGET = 0.05  # of a layer's bytes read, what its advisory prefetches may waste
WASTE_DECAY = 0.99  # per call: both tallies look back some 100 calls (a prefill's reads fade)


class Prefetching(SlotFills):
    """How LayerSlots reads a prediction ahead, scores it, and drops what a call did not
    need (its state: LayerSlots')."""

    @property
    def earned(self) -> bool:
        """Whether advisory predictions have earned their reads: enough of them used, and
        what prefetches wasted within the waste budget."""
        return (self.scored >= TRUST_AFTER and self.precision >= MIN_PRECISION
                and self.wasted_bytes <= WASTE_BUDGET * self.bytes_read)

    def prefetch(self, experts: np.ndarray, lead: int = 0):
        """Start reading `experts` (a prediction) where slots can be had without waiting.

        `lead` is how many of this layer's calls pass before the predicted one: 0 for a
        prediction about the current token, 1 for one about the next token. What finds
        no room now is read as soon as this layer's current call releases its slots.
        A `gated` pool's predictions are advice: they read only once they have earned it
        (`earned`); else the prediction is the routing itself.
        """
        experts = experts[self.owned[experts]]  # a host reads ahead only its own experts
        with self.lock:
            if lead == 0:
                self.pending_prediction = set(experts.tolist())
            else:
                self.next_prediction = set(experts.tolist())
            trusted = not self.gated or self.earned
        if trusted:  # (an untrusted prediction is only scored)
            self._fill_ahead(experts)

    def _fill_ahead(self, experts: np.ndarray):
        new = []
        try:
            with self.lock:
                # the experts predicted for this layer's next call stay too, and a guess
                # never evicts what the layer's last call used (likely needed again)
                pinned = set(experts.tolist()) | (self.pending_prediction or set())
                if self.gated:  # advice
                    pinned |= self.last_call
                room = Room(self, pinned)  # (found once: a long prefill's look-ahead is many)
                for e in experts.tolist():
                    if self.slot_of[e] >= 0:
                        continue
                    if not room.fits(e):
                        break  # release() reads the rest once this layer's call is done
                    if self.gated and not self._worth_a_slot(e, pinned):
                        continue
                    new.append(self._start_fill(e, pinned=pinned, prefetch=True, room=room))
                    self.stats.prefetches += 1
                    self.prefetched.add(e)
        finally:
            self._submit(new)

    def _score_prediction(self, wanted):
        if self.pending_prediction:
            used = len(self.pending_prediction.intersection(wanted))
            self.stats.predicted += len(self.pending_prediction)
            self.stats.predicted_used += used
            self.stats.needed += len(wanted)
            share = used / len(self.pending_prediction)
            self.precision = share if not self.scored else \
                PRECISION_DECAY * self.precision + (1 - PRECISION_DECAY) * share
            self.scored += 1
        self.pending_prediction, self.next_prediction = self.next_prediction, None

    def _cancel_stale(self, stale):
        """Prefetches for this call of experts it did not request: those not yet begun are
        dropped unread (the caller holds the lock), so that the reads this call does need
        do not queue behind them. A cancelled fill keeps its slot until the reader ends it."""
        cancel = getattr(self.reader, "cancel", None)
        for e in stale:
            fill = self.fills.get(e)
            if fill is None or e not in self.prefetched or cancel is None or not cancel(fill):
                continue
            del self.fills[e]
            self.cancelled.append(fill)
            self.slot_of[e] = -1
            self.expert_in[fill.slot] = -1
            self.prefetched.discard(e)
            self.policy.forget(e)
            self.stats.prefetch_cancelled += 1

    def _worth_a_slot(self, expert: int, pinned) -> bool:
        """Whether a guess may have a slot: a free one, or the policy's victim's if the
        policy ranks the guess hotter (never one it would keep over the guess)."""
        if (self.state == FREE).any():
            return True
        heat = getattr(self.policy, "heat", None)
        return heat is not None and heat(expert) > heat(self._victim(pinned))
