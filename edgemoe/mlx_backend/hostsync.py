"""The decode path's host syncs, in one place, and what lets it do without most of them.

A MoE layer's call waits on the device once at most: for its routing (`wait`). Its
experts' compute is left queued (no evaluation after it), so the slots it reads stay in
use until an evaluation that includes its output has returned: `QueuedReads` holds those
slots and releases them at the next sync of any layer, which evaluates the held outputs
with its own routing (they are in its graph anyway: the next layer's input depends on this
layer's output). GUIDE: never refill a slot that a queued computation still reads. A slot
pool that needs a held slot before any sync comes (`LayerSlots.flush`) gets it by one
evaluation of the held outputs.

Every host wait of the streaming expert path goes through `wait`, so that a count of
`mx.eval` calls (scripts/bench_hotpath.py, tests/test_hotpath.py) counts them all.
"""

import itertools
from typing import Callable, Dict, List, Tuple

import mlx.core as mx

TALLY_BATCH = 256  # resident calls' tallies counted together after this many


def wait(*arrays) -> None:
    """Evaluate `arrays`: the host waits for the device."""
    mx.eval(*arrays)


def start(*arrays) -> None:
    """Start evaluating `arrays` without waiting (nothing: none)."""
    if arrays:
        mx.async_eval(*arrays)


class QueuedReads:
    """A model's queued device work that the host must settle before reusing memory or
    reporting counts:

    - held: slot pools whose slots a queued computation reads, with those computations'
      outputs; a pool is released once an evaluation that included its outputs returned;
    - predictions: evaluated later, with the next sync (prerouted decode: no routing sync
      until the next token's first layer whose routing is not known), then handed to
      their callback;
    - tallies: per pool, each resident call's expert ids (already on the device, nothing
      added to its graph); the distinct experts they requested are counted and added to
      the store's hits when settled (`settle_tallies`), so that a resident layer keeps its
      statistics without a host round trip.
    """

    def __init__(self):
        self.held: Dict[object, List[mx.array]] = {}
        self.predictions: List[Tuple[dict, Callable[[dict], None]]] = []
        self.tallies: List[Tuple[int, object, mx.array]] = []  # (forward call, pool, ids
        #                                                        or a count of several)
        self.calls = 0  # forward calls begun (StreamingModel.__call__)
        self.layer_calls: Dict[int, int] = {}  # calls of each MoE layer (by its index)

    def hold(self, pool, output: mx.array):
        self.held.setdefault(pool, []).append(output)

    def defer(self, predictions: dict, then: Callable[[dict], None]):
        """Evaluate `predictions` with the next sync, then call `then` with them."""
        if predictions:
            self.predictions.append((predictions, then))

    def sync(self, *arrays):
        """One host sync: `arrays` and everything pending (the held outputs, the deferred
        predictions); then the held pools are released and the predictions handed on."""
        held, predictions = self.held, self.predictions
        wait(*arrays, *itertools.chain.from_iterable(held.values()),
             *((p for preds, _ in predictions for p in preds.values()) if predictions else ()))
        self.held, self.predictions = {}, []
        for pool in held:
            pool.release()
        for preds, then in predictions:
            then(preds)

    def flush(self) -> bool:
        """Evaluate what is pending (a pool needs a held slot); False when nothing was."""
        if not self.held and not self.predictions:
            return False
        self.sync()
        return True

    def tally(self, pool, ids: mx.array, num_experts: int):
        """A resident call of `pool` routed to `ids` (..., k). A prompt chunk's ids start
        computing now: after a chunk mlx-lm evaluates only the KV cache, so the last layer's
        routing is in no graph it evaluates. Held lazily, every chunk's would keep that
        layer's attention graph (its cache as it was, too), all computed at once by the next
        settle: a 32K-token prompt peaked at 16.9 GB so. (A decode step's ids, one token a
        sequence, are in the graph of its tokens: they need no evaluation of their own.)"""
        if ids.ndim >= 2 and ids.shape[-2] > 1:  # (batch, tokens, k), or (tokens, k)
            try:
                start(ids)
            except ValueError:  # inside a graph transformation (training: the loss, which
                pass  # its caller evaluates, needs every layer's routing; nothing is left)
        self.tallies.append((self.calls, pool, (ids, num_experts)))
        if len(self.tallies) >= 2 * TALLY_BATCH:  # keep the list short, still lazy
            old, self.tallies = self.tallies[:TALLY_BATCH], self.tallies[TALLY_BATCH:]
            self.tallies[:0] = [(old[-1][0], p, c) for p, c in _counts(old)]

    def settle_tallies(self, everything: bool = False):
        """Add the resident calls' counts to their pools' statistics: those of forward calls
        before the latest (whose device work is done in a decode loop: its token was read),
        or `everything` (then the host may wait)."""
        done = [t for t in self.tallies if everything or t[0] < self.calls]
        if not done:
            return
        self.tallies = [t for t in self.tallies if not (everything or t[0] < self.calls)]
        counts = _counts(done)
        wait(*(c for _, c in counts))
        for pool, count in counts:
            pool.count_resident_hits(int(count.item()))


def _counts(tallies) -> List[Tuple[object, mx.array]]:
    """(pool, the distinct experts its tallied calls requested, summed over the calls): the
    calls of one shape counted together, a few operations for many calls."""
    groups: Dict[tuple, list] = {}
    for _, pool, entry in tallies:
        key = (pool, entry[0].shape, entry[1]) if isinstance(entry, tuple) else (pool, None, 0)
        groups.setdefault(key, []).append(entry if key[1] is None else entry[0])
    counts = []
    for (pool, shape, num_experts), entries in groups.items():
        if shape is None:  # counts already
            counts.append((pool, mx.sum(mx.stack(entries))))
            continue
        calls = mx.stack(entries).reshape(len(entries), -1, 1)
        experts = mx.arange(num_experts, dtype=calls.dtype)
        counts.append((pool, (calls == experts).any(axis=1).sum()))
    return counts
