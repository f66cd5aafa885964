"""The learned cache policy (experimental): evict the expert a small model predicts is
needed farthest in the future (FlashMoE's approach).

Measured against LFU, the default, on both bundled models (docs/benchmarks.md,
"Variants"): +1.0 point of decode hit rate on the earlier model at a 10% budget, a tie at
25%; -0.3, -0.5 and 0.0 points on the bundled one. It stays for research, chosen only by
name (`--cache-policy learned`); edgemoe.whatif.experimental.fit_learned fits its
weights (`python -m edgemoe.cache_sim train-learned`).
"""

from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

from ...format.source import pack_asset
from ...streaming.cache import register_policy

# fitted on the bundled model's traces; a pack may carry its own (cache_policy.npz)
DEFAULT_LEARNED = Path(__file__).resolve().parents[2] / "models" / "fine" / "cache_policy.npz"


@dataclass
class NextUseModel:
    """A 2-layer MLP from an expert's recency and frequency features to the log of
    its predicted distance to next use. Fitted by `python -m edgemoe.cache_sim
    train-learned` to approximate Belady's next-use distances."""

    mean: np.ndarray
    std: np.ndarray
    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray

    def predict(self, x: np.ndarray) -> np.ndarray:
        h = np.tanh(((x - self.mean) / self.std) @ self.w1 + self.b1)
        return h @ self.w2 + self.b2

    def save(self, path):
        with open(path, "wb") as f:
            np.savez(f, **vars(self))

    @classmethod
    def load(cls, path) -> "NextUseModel":
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(
                f"{path}: no learned cache policy; fit one with `python -m edgemoe.cache_sim "
                f"train-learned TRACE [TRACE ...] --out {path}`")
        with np.load(path) as data:
            missing = {"mean", "std", "w1", "b1", "w2", "b2"} - set(data.files)
            if missing:
                raise ValueError(f"{path}: not a learned cache policy "
                                 f"(missing {', '.join(sorted(missing))})")
            return cls(**{k: data[k] for k in data.files})


@lru_cache(maxsize=8)
def _load_model(path: str) -> NextUseModel:
    return NextUseModel.load(path)


class LearnedPolicy:
    """Evict the expert a small model predicts will be needed farthest in the future
    (FlashMoE's approach). Its features are computed from the touches alone, so a
    replay of a trace gives them (`edgemoe.cache_sim train-learned`)."""

    WINDOWS = (16, 64, 256)  # touches
    FEATURES = ("log gap", "rate 16", "rate 64", "rate 256", "rate all", "recency rank")

    def __init__(self, model: Optional[NextUseModel] = None):
        self.model = model
        self.clock = 0
        self._recent = {}  # expert -> deque of its touch times within the longest window
        self._uses = {}  # expert -> all its touches
        self._last = {}  # expert -> time of its last touch
        self._resident = OrderedDict()  # touched and not forgotten

    @classmethod
    def from_file(cls, path=None) -> "LearnedPolicy":
        return cls(_load_model(str(path or DEFAULT_LEARNED)))

    @classmethod
    def for_model(cls, folder: Optional[Path] = None) -> "LearnedPolicy":
        """With the weights the model's folder carries (cache_policy.npz), else the
        bundled ones."""
        return cls.from_file(pack_asset(folder, "cache_policy") if folder else None)

    def touch(self, expert: int):
        self.clock += 1
        recent = self._recent.setdefault(expert, deque())
        recent.append(self.clock)
        while recent[0] <= self.clock - self.WINDOWS[-1]:
            recent.popleft()
        self._uses[expert] = self._uses.get(expert, 0) + 1
        self._last[expert] = self.clock
        self._resident[expert] = None

    def forget(self, expert: int):
        self._resident.pop(expert, None)

    def features(self, experts) -> np.ndarray:
        """One row per expert (each touched before): the model's input now."""
        n = len(self._last)  # experts seen; a uniform router uses each once in n touches
        lasts = np.fromiter(self._last.values(), np.int64, n)
        rows = []
        for e in experts:
            gap = self.clock - self._last[e]
            recent = self._recent[e]
            rates = [sum(t > self.clock - w for t in recent) * n / w for w in self.WINDOWS]
            rows.append([np.log1p(gap / n), *rates, self._uses[e] * n / self.clock,
                         np.count_nonzero(lasts > self._last[e]) / n])
        return np.array(rows, dtype=np.float64).reshape(-1, len(self.FEATURES))

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        pinned = set(pinned)
        candidates = [e for e in self._resident if e not in pinned]  # least recent first
        if not candidates:
            return None
        return candidates[int(np.argmax(self.model.predict(self.features(candidates))))]

    def heat(self, expert: int) -> float:
        """Minus its predicted distance to next use; never touched: the coldest."""
        if expert not in self._last:
            return -np.inf
        return -float(self.model.predict(self.features([expert]))[0])


register_policy("learned", LearnedPolicy.for_model)  # --cache-policy learned
