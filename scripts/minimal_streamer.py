"""A yardstick for the decode hot path (#50): the least an exact expert streamer with one
routing sync per MoE layer and a reader thread must do on the host, in a few lines.

    bench_hotpath.py --minimal 50%

Each of mlx-lm's expert modules is replaced by a `MinimalStreamer`: mlx-lm's own module over
a pool of slots (the same slot count as edgemoe's at that budget), the router's ids read
back (`tolist`: the routing sync), an LRU dict of expert -> slot, the misses copied into
their slots by one reader thread (one queue put and one Event a call), the slot ids to the
device as a new array; mlx-lm's graph over the slots. Its tokens are mlx-lm's (the same
remapped `gather_qmm` as edgemoe's).

What it leaves out, so that its cost is a floor, not a rival: statistics, a cache policy
beyond LRU, locks (its reader writes only bytes the call waits for), errors, timeouts and
checksums, prefetching, and the slot-in-use rule (a decode step's earlier graphs are
evaluated before a layer's next call, so no slot it reuses is still read). Its "reads"
are copies from mlx-lm's experts in memory (a warm page cache, as edgemoe's warm runs).
Prompts (more than one token) run mlx-lm's own module: the yardstick is for decode.
"""

import collections
import copy
import queue
import threading
from typing import List

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


class MinimalReader:
    """One thread that copies (source rows, slot rows) pairs, then sets the call's Event."""

    def __init__(self):
        self.queue: "queue.SimpleQueue" = queue.SimpleQueue()
        threading.Thread(target=self._run, daemon=True, name="minimal-reader").start()

    def _run(self):
        while True:
            copies, done = self.queue.get()
            for source, slot in copies:
                slot[...] = source
            done.set()


class MinimalStreamer:
    """mlx-lm's expert module `full` streamed through `num_slots` slots (see the module)."""

    def __init__(self, full, num_slots: int, reader: MinimalReader):
        self.full, self.reader = full, reader
        num_experts = full.gate_proj.weight.shape[0] if hasattr(full, "gate_proj") \
            else full.fc1.weight.shape[0]
        self.pool = copy.deepcopy(full)
        slots, self.sources, self.slot_rows = [], [], []
        for name, array in tree_flatten(full.parameters()):
            if array.shape[0] != num_experts:
                continue
            source = np.array(array)
            host = mx.array(np.zeros((num_slots, *source.shape[1:]), dtype=source.dtype))
            mx.eval(host)
            slots.append((name, host))
            self.sources.append(source)
            self.slot_rows.append(np.asarray(host))  # (shares the array's memory)
        self.pool.update(tree_unflatten(slots))
        self.slot_of: "collections.OrderedDict[int, int]" = collections.OrderedDict()
        self.free: List[int] = list(range(num_slots))[::-1]
        self.calls = self.misses = 0  # decode calls, and their misses

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if indices.size > indices.shape[-1]:  # a prompt: mlx-lm's own module
            return self.full(x, indices)
        ids = indices.tolist()  # the routing sync
        self.calls += 1
        while isinstance(ids[0], list):
            ids = ids[0]
        slot_of, copies = self.slot_of, []
        wanted = set(ids)
        for e in wanted:
            if e in slot_of:
                slot_of.move_to_end(e)
        for e in wanted:
            if e not in slot_of:
                if self.free:
                    slot = self.free.pop()
                else:  # the least recently used expert this call does not want
                    slot = slot_of.pop(next(v for v in slot_of if v not in wanted))
                slot_of[e] = slot
                copies += [(s[e], rows[slot]) for s, rows in zip(self.sources, self.slot_rows)]
                self.misses += 1
        done = None
        if copies:
            done = threading.Event()
            self.reader.queue.put((copies, done))
        slot_ids = mx.array([slot_of[e] for e in ids], dtype=mx.uint32).reshape(indices.shape)
        out = self.pool(x, slot_ids)
        if done is not None:
            done.wait()
        return out


def install(model, num_slots: int) -> List[MinimalStreamer]:
    """Replace each of `model`'s routed-expert modules (`switch_mlp`) by a MinimalStreamer of
    `num_slots` slots, one reader thread for all; the streamers, in layer order."""
    from mlx_lm.models.switch_layers import SwitchGLU, SwitchMLP

    found = [(module, name, child) for _, module in model.named_modules()
             for name, child in module.children().items()
             if isinstance(child, (SwitchGLU, SwitchMLP))]
    reader, installed = MinimalReader(), []
    for module, name, child in found:
        streamer = MinimalStreamer(child, num_slots, reader)
        setattr(module, name, streamer)
        installed.append(streamer)
    return installed
