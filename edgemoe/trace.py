"""Routing traces: which experts each token used at each MoE layer, in order.

A trace is a compressed numpy archive (.npz):

    layers     int32 (n_layers,)               decoder index of each MoE layer
    routed     int32 (n_tokens, n_layers, k)   expert ids the router chose
    decode     bool  (n_tokens,)               False for prompt tokens, True for decoded
    predicted  int32 (n_tokens, n_layers, k')  predicted ids, when a predictor ran
    expert_bytes  int64 (n_layers,)            bytes of one expert record per layer
    num_experts   int32 (n_layers,)            routed experts per layer

Tokens are in the order the model saw them; a batch of several sequences is
recorded sequence by sequence for each forward call.
"""

from pathlib import Path
from typing import Dict, List, Optional

import numpy as np


class TraceRecorder:
    """Collects the routing of every forward call; `save()` writes the .npz."""

    def __init__(self, layers: List[int], expert_bytes: List[int], num_experts: List[int]):
        self.layers = list(layers)
        self.expert_bytes = list(expert_bytes)
        self.num_experts = list(num_experts)
        self._pending: Dict[int, np.ndarray] = {}
        self._predicted: Dict[int, np.ndarray] = {}
        self.routed: List[np.ndarray] = []
        self.predicted: List[np.ndarray] = []
        self.decode: List[np.ndarray] = []

    def record(self, layer: int, ids: np.ndarray, predicted: Optional[np.ndarray] = None):
        """One MoE layer's routing for one forward call: ids of shape (..., k)."""
        self._pending[layer] = ids.reshape(-1, ids.shape[-1])
        if predicted is not None:
            self._predicted[layer] = predicted.reshape(-1, predicted.shape[-1])
        if layer == self.layers[-1]:
            self._end_call()

    def _end_call(self):
        if set(self._pending) != set(self.layers):
            self._pending.clear()
            return  # an incomplete forward (should not happen); keep the trace clean
        routed = np.stack([self._pending[l] for l in self.layers], axis=1)
        self.routed.append(routed)
        self.decode.append(np.full(len(routed), len(routed) == 1))
        if self._predicted:
            self.predicted.append(np.stack([self._predicted[l] for l in self.layers], 1))
        self._pending.clear()
        self._predicted.clear()

    def save(self, path):
        arrays = dict(
            layers=np.array(self.layers, dtype=np.int32),
            routed=np.concatenate(self.routed).astype(np.int32),
            decode=np.concatenate(self.decode),
            expert_bytes=np.array(self.expert_bytes, dtype=np.int64),
            num_experts=np.array(self.num_experts, dtype=np.int32),
        )
        if self.predicted:
            arrays["predicted"] = np.concatenate(self.predicted).astype(np.int32)
        with open(path, "wb") as f:  # np.savez_compressed would append .npz to a str path
            np.savez_compressed(f, **arrays)


def load_trace(path) -> Dict[str, np.ndarray]:
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such trace")
    with np.load(path) as data:
        return {k: data[k] for k in data.files}


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
