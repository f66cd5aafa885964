"""A long prefill's look-ahead: a layer's first pass read while its attention computes.

A MoE layer's reads start once its routing is known, after its attention and router: in
a prefill chunk under a small budget, the first pass of every layer's call waits for its
reads, and none of them overlaps attention (issue #55). But a chunk of T tokens routed
top-k with T x k a few times a layer's experts (`AHEAD_FACTOR`) needs nearly every one of
them, so which to read first needs no routing. Before a layer's routing sync, `look_ahead`
fills the pool's free slots with as many experts as its call's first pass computes
(edgemoe.streaming.calls.pass_size), ranked by the pool's cache policy (LFU: the most used
so far, this prompt's earlier chunks included), then by id. `run_call` puts the experts
already in slots first, so they are that pass, and the reads of the next pass start while
it computes, as before.

Exact: only when a read happens changes, never what is computed. Each expert is still read
once a chunk: the look-ahead reads only experts not in slots, into free slots (nothing is
evicted for it), at most one pass of them, so a call that wants them computes them in its
first pass; one the call does not want is dropped unread if its read has not begun, else
kept in its slot like any other (a prefetch of `lead` 0: counted in the store's stats as
prefetches, their use as `predicted_used`). Native routing only: a routing mode's own
predictions use the same prefetch, and advisory pools read only predictions that earned it.
Both the model (edgemoe.mlx_backend.experts) and the twin (edgemoe.whatif.twin.engine)
call it, at the same point of a layer's call.
"""

import numpy as np

from .calls import pass_size
from .fills import FREE
from .slots import LayerSlots

LOOK_AHEAD = True  # False: every read waits for its routing (benchmarks, the twin's before)
AHEAD_FACTOR = 2  # a call's (token, expert) entries per expert of the layer to look ahead


def look_ahead(pool: LayerSlots, entries: int) -> int:
    """Start reading the first pass of `pool`'s coming call of `entries` (token, expert)
    entries into its free slots; how many reads it started."""
    experts = pool.layer.num_experts
    if not LOOK_AHEAD or pool.num_slots >= experts or entries < AHEAD_FACTOR * experts:
        return 0
    with pool.lock:
        absent = (pool.slot_of < 0) & pool.owned
        room = min(int((pool.state == FREE).sum()),
                   pass_size(pool.num_slots) - int((pool.slot_of >= 0).sum()))
    candidates = [e for e in np.flatnonzero(absent).tolist()
                  if pool.layer.records[e] is not None]
    if room <= 0 or not candidates:
        return 0
    heat = getattr(pool.policy, "heat", None)
    if heat is not None:  # (sorted is stable: ties stay in id order)
        candidates = sorted(candidates, key=heat, reverse=True)
    chosen = np.array(sorted(candidates[:room]), dtype=np.int64)
    pool.prefetch(chosen, lead=0)
    return len(chosen)
