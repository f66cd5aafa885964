"""Routing traces: which experts each token used at each MoE layer, in order.

A trace is a compressed numpy archive (.npz):

    layers        int32 (n_layers,)             decoder index of each MoE layer
    routed        int32 (n_tokens, n_layers, k) expert ids the router chose
    decode        bool  (n_tokens,)             False for prompt tokens, True for decoded
    calls         int32 (n_calls,)              tokens (rows) of each forward call
    expert_bytes  int64 (n_layers,)             bytes of one expert record per layer
    num_experts   int32 (n_layers,)             routed experts per layer
    model         str                           the pack's fingerprint (Pack.fingerprint)
    prefetch_at   int32 (n_prefetches, 4)       [call, position of the MoE layer whose call
                                                 issued it, target layer position, lead]
    prefetch_experts, prefetch_counts           the experts of each prefetch, concatenated

Tokens are in the order the model saw them; a batch of several sequences is recorded
row by row for each forward call. Traces written before `calls` and `model` existed
still load: edgemoe.cache_sim then assumes mlx-lm's prefill chunks.
"""

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np


class TraceRecorder:
    """Collects the routing of every forward call and every prefetch; `save()` writes
    the .npz."""

    def __init__(self, layers: List[int], expert_bytes: List[int], num_experts: List[int],
                 model: Optional[str] = None):
        self.layers = list(layers)
        self.expert_bytes = list(expert_bytes)
        self.num_experts = list(num_experts)
        self.model = model
        self.prefetch_gated = False  # the store gated advisory prefetches (slots.py)
        self._position = {layer: i for i, layer in enumerate(self.layers)}
        self._pending: Dict[int, np.ndarray] = {}
        self._pending_decode = False
        self._current = -1  # position of the layer whose call runs now
        self.routed: List[np.ndarray] = []
        self.decode: List[np.ndarray] = []
        self.prefetches: List[tuple] = []  # (call, source position, target position, lead, experts)

    def record(self, layer: int, ids: np.ndarray):
        """One MoE layer's routing for one forward call: ids of shape (..., k)."""
        if layer in self._pending:  # a new forward call
            self._end_call()
        # (B, L, k), or (tokens, k) for a block that flattens them: decoding is one position
        self._pending_decode = (ids.shape[1] if ids.ndim == 3 else ids.shape[0]) == 1
        self._pending[layer] = ids.reshape(-1, ids.shape[-1])
        self._current = self._position[layer]

    def record_prefetch(self, layer: int, experts: np.ndarray, lead: int):
        call = len(self.routed)  # the call in progress
        self.prefetches.append((call, self._current if self._pending else -1,
                                self._position[layer], lead, np.asarray(experts).tolist()))

    def _end_call(self):
        if set(self._pending) == set(self.layers):  # an incomplete forward is left out
            routed = np.stack([self._pending[l] for l in self.layers], axis=1)
            self.routed.append(routed)
            self.decode.append(np.full(len(routed), self._pending_decode))
        self._pending.clear()
        self._current = -1

    def save(self, path):
        if self._pending:
            self._end_call()
        arrays = dict(
            layers=np.array(self.layers, dtype=np.int32),
            routed=np.concatenate(self.routed).astype(np.int32),
            decode=np.concatenate(self.decode),
            calls=np.array([len(r) for r in self.routed], dtype=np.int32),
            expert_bytes=np.array(self.expert_bytes, dtype=np.int64),
            num_experts=np.array(self.num_experts, dtype=np.int32),
            prefetch_at=np.array([p[:4] for p in self.prefetches], dtype=np.int32).reshape(-1, 4),
            prefetch_counts=np.array([len(p[4]) for p in self.prefetches], dtype=np.int32),
            prefetch_experts=np.array([e for p in self.prefetches for e in p[4]],
                                      dtype=np.int32),
        )
        if self.model is not None:
            arrays["model"] = np.array(self.model)
        arrays["prefetch_gated"] = np.array(self.prefetch_gated)
        if hasattr(path, "write"):
            np.savez_compressed(path, **arrays)
            return
        with open(path, "wb") as f:  # np.savez_compressed would append .npz to a str path
            np.savez_compressed(f, **arrays)

    def as_trace(self) -> Dict[str, np.ndarray]:
        """What `load_trace` would give for this recording, without a file."""
        import io

        buf = io.BytesIO()
        self.save(buf)
        buf.seek(0)
        with np.load(buf) as data:
            return {k: data[k] for k in data.files}


def load_trace(path) -> Dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace")
    try:
        with np.load(path) as data:
            trace = {k: data[k] for k in data.files}
    except (ValueError, OSError) as e:
        raise ValueError(f"{path}: not a routing trace ({e})") from None
    missing = {"layers", "routed", "decode"} - set(trace)
    if missing:
        raise ValueError(f"{path}: not a routing trace (missing {', '.join(sorted(missing))})")
    return trace


def check_trace_matches(trace: Dict[str, np.ndarray], pack, where) -> None:
    """Refuse a trace recorded on another model than `pack` (by fingerprint, or for
    older traces by layers, expert counts and record sizes)."""
    if "model" in trace and str(trace["model"]) != pack.fingerprint:
        raise ValueError(f"{where}: recorded on another model (fingerprint "
                         f"{str(trace['model'])}, {pack.path} has {pack.fingerprint})")
    layers = [l.index for l in pack.layers]
    if trace["layers"].tolist() != layers:
        raise ValueError(f"{where}: recorded on another model (MoE layers "
                         f"{trace['layers'].tolist()}, {pack.path} has {layers})")
    for key, found in (("num_experts", [l.num_experts for l in pack.layers]),
                       ("expert_bytes", [l.expert_bytes for l in pack.layers])):
        if key in trace and trace[key].tolist() != found:
            raise ValueError(f"{where}: recorded on another model ({key} "
                             f"{trace[key].tolist()}, {pack.path} has {found})")


def routing_stats(trace: Dict[str, np.ndarray], num_experts: int) -> List[dict]:
    """Per MoE layer: how often each expert was chosen, and the entropy of that usage
    (in bits; log2(num_experts) when all experts are used equally)."""
    stats = []
    for i, layer in enumerate(trace["layers"].tolist()):
        counts = np.bincount(trace["routed"][:, i].reshape(-1), minlength=num_experts)
        p = counts / counts.sum()
        entropy = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
        stats.append({"layer": layer, "counts": counts.tolist(), "entropy_bits": entropy,
                      "max_entropy_bits": float(np.log2(num_experts))})
    return stats
