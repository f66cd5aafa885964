"""The call protocol of every routed-expert module, whatever computes it.

One call of a MoE layer: the router's expert ids (..., k) -> the distinct experts ->
passes of at most `num_slots` of them (only a long prefill under a small budget needs
more than one; then each is half the pool) -> for each pass: `ensure` (the experts ready
in slots), `read_ahead` of the next pass into the other half, compute over the slots,
`release`. Release is always reached, also when a read or the computation
fails, so that an error leaves the pool usable for the next call.

A backend supplies only `compute(rows, slot_ids)`:
- one pass: `rows` is None and `slot_ids` has the shape of `ids` (every entry's slot);
- several passes: `rows` are the flat (token * k + j) entries this pass covers and
  `slot_ids` their slots, flat.
A host of several (edgemoe.distributed) computes only the entries routed to its own
experts: `rows` given to `run_call` are those, and every pass gets its share of them
(none at all, when no entry is this host's: `compute` then gets empty rows).
`compute` must not return before the slots' reads are done or ordered on the device
(MLX: evaluated; CUDA: an event recorded), since a released slot may be refilled; or, with
`hold`, a call of one pass keeps its slots in use when it returns, and the caller releases
them once the device is done with them (edgemoe.mlx_backend.hostsync.QueuedReads).
"""

from typing import Callable, List, Optional, Tuple, TypeVar

import numpy as np

from .slots import LayerSlots

T = TypeVar("T")


READ_AHEAD = True  # False: passes of a whole pool, read one after another (benchmarks)
COUNT_ABOVE = 256  # a call of more (token, expert) entries finds its experts by a count


def pass_size(num_slots: int) -> int:
    """The experts of one pass of a call that needs more than `num_slots`: half the pool,
    so that while one half computes a pass the other half reads the next
    (`LayerSlots.read_ahead`); the whole pool without read-ahead."""
    return max(1, num_slots // 2) if READ_AHEAD else num_slots


def passes(experts: np.ndarray, num_slots: int) -> List[np.ndarray]:
    """Sorted distinct experts in groups that fit a pool of `num_slots`: one group if they
    all fit, else groups of `pass_size`."""
    if len(experts) <= num_slots:
        return [experts]
    size = pass_size(num_slots)
    return [experts[start:start + size] for start in range(0, len(experts), size)]


def run_call(slots: LayerSlots, ids: np.ndarray,
             compute: Callable[[Optional[np.ndarray], np.ndarray], T],
             routed: Optional[Callable[[], None]] = None,
             rows: Optional[np.ndarray] = None,
             hold: bool = False) -> List[Tuple[Optional[np.ndarray], T]]:
    """Compute one layer call over the slots; (rows, output) for each pass.

    `routed()` runs once the first pass's experts are in slots and before compute, so the
    reads it starts (prefetches for later layers) overlap this layer's computation.
    `rows`: only these flat entries (a host's own), always computed by rows.
    `hold`: a call of one pass (its part's rows None) returns with its slots still in use.
    """
    if slots.trace is not None:
        slots.record_routing(ids)
    flat = ids.reshape(-1)
    chosen = flat if rows is None else flat[rows]
    # (sorted distinct ids: a set, not np.unique, for the few ids of a decode step; a count
    # for the many of a prefill chunk; a list where they fit the pool, as `ensure` takes them)
    groups = [sorted(set(chosen.tolist())) if chosen.size <= COUNT_ABOVE else
              np.flatnonzero(np.bincount(chosen, minlength=slots.layer.num_experts)).tolist()]
    if len(groups[0]) > slots.num_slots:  # (a verify window or a prefill over a small pool)
        distinct = np.array(groups[0], dtype=chosen.dtype)
        # the experts already in slots go first (among them those a long prefill read
        # ahead: edgemoe.streaming.prefill_ahead), so no pass evicts one a later pass uses
        # (outputs are per entry, so the order of passes changes no bit)
        distinct = distinct[np.argsort(slots.slot_of[distinct] < 0, kind="stable")]
        groups = passes(distinct, slots.num_slots)
        # each chosen entry's pass, found once (not an `isin` over the entries a pass)
        pass_of = np.empty(slots.layer.num_experts, dtype=np.int64)
        for i, group in enumerate(groups):
            pass_of[group] = i
        entry_pass = pass_of[chosen]
    results = []
    held = hold and len(groups) == 1 and rows is None
    for i, group in enumerate(groups):
        slot_of = slots.ensure(group, new_call=i == 0)
        done = False
        try:
            if READ_AHEAD and i + 1 < len(groups):  # the next pass loads while this computes
                slots.read_ahead(groups[i + 1])
            if i == 0 and routed is not None:
                routed()
            if len(groups) == 1 and rows is None:
                results.append((None, compute(None, slot_of[ids])))
            else:
                if len(groups) == 1:  # (a host's rows, all of them in its one pass)
                    part = rows
                else:
                    part = entry_pass == i
                    part = np.flatnonzero(part) if rows is None else rows[part]
                results.append((part, compute(part, slot_of[flat[part]])))
            done = True
        finally:
            if not (held and done):  # (a failed call releases at once)
                slots.release()
    return results
