"""Hits first (#50 item 3; off: edgemoe.mlx_backend.experts.HITS_FIRST): a native decode
call with misses starts computing the rows of its hits while its misses are read, then the
rows of its misses, bit-identical to mlx-lm's call.
"""

from typing import Optional

import mlx.core as mx
import numpy as np

from .hostsync import start


def hits_first_call(call, x: mx.array, ids: np.ndarray) -> Optional[mx.array]:
    """A decode call of `call` (a StreamingExperts) whose experts fit the slots, on the
    plain path (`LayerSlots.claim`): the rows of its hits start computing (`start`: no
    wait) while its misses are read, then the rows of its misses; the outputs go back in
    mlx-lm's (token, k) order, so the block's weighted sum is mlx-lm's, bit for bit (each
    row is its own `gather_qmm` product, as in the passes of `run_call`). None (nothing
    done) for any other call."""
    flat = ids.reshape(-1)
    wanted = sorted(set(flat.tolist()))
    if len(wanted) > call.slots.num_slots or call.slots.trace is not None:
        return None
    fills = call.slots.claim(wanted)
    if fills is None:
        return None
    call.bind_deltas()
    if not fills:  # every expert in a slot: one pass, as run_call's
        out = call.pool.module(x, mx.array(call.slots.slot_of[ids].astype(np.uint32)))
        call.streaming.queued.hold(call.slots, out)
        return out
    try:
        missed = np.isin(flat, [f.expert for f in fills])
        tokens, k = x.reshape(-1, x.shape[-1]), ids.shape[-1]

        def rows_out(rows):
            slot_ids = call.slots.slot_of[flat[rows]].astype(np.uint32)[:, None]
            return call.pool.module(tokens[mx.array(rows // k)], mx.array(slot_ids))[:, 0]

        hit_rows, miss_rows = np.flatnonzero(~missed), np.flatnonzero(missed)
        parts = [rows_out(hit_rows)] if hit_rows.size else []
        start(*parts)
        call.slots.finish(fills)
        parts.append(rows_out(miss_rows))
    except BaseException:
        call.slots.release()
        raise
    order = np.argsort(np.concatenate([hit_rows, miss_rows]))
    out = mx.concatenate(parts)[mx.array(order)].reshape(*ids.shape, -1)
    call.streaming.queued.hold(call.slots, out)
    return out
