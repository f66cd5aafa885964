"""Which resident expert a layer's slot pool gives up when it needs room.

A policy is told of every use (`touch`) and every eviction (`forget`) in its layer, and
names a `victim` that is not pinned. The store touches every expert a step needs, hits
and misses alike, before it loads the misses (and again as each fill starts); so an
expert touched and not forgotten is resident or about to be loaded. A policy cannot
tell the two apart: `pinned` must hold every expert the current step needs, loaded or
not. Policies that need a clock count touches.

A policy that can rank an expert it does not hold has `heat(expert)`: higher is kept
longer, comparable across one layer's experts, resident or not. An advisory prefetch
evicts only an expert colder than its prediction (`edgemoe.streaming.slots`); under a
policy without `heat` it takes free slots only.

Belady's optimum needs the future; it lives in `edgemoe.streaming.replay`, which replays
recorded routing traces through these policies and measures them against it.
"""

from collections import OrderedDict, deque
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

# fitted on the bundled model's traces; a pack may carry its own (cache_policy.npz)
DEFAULT_LEARNED = Path(__file__).resolve().parents[1] / "models" / "fine" / "cache_policy.npz"


class LRUPolicy:
    """Evict the expert used longest ago."""

    def __init__(self):
        self._order = OrderedDict()  # expert -> None, oldest first
        self._clock = 0
        self._last = {}  # expert -> its last touch, kept after eviction

    def touch(self, expert: int):
        self._order[expert] = None
        self._order.move_to_end(expert)
        self._clock += 1
        self._last[expert] = self._clock

    def forget(self, expert: int):
        self._order.pop(expert, None)

    def heat(self, expert: int):
        return self._last.get(expert, 0)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        """The expert to evict, never one of `pinned` (those the current step uses)."""
        pinned = set(pinned)
        return next((e for e in self._order if e not in pinned), None)


class LFUPolicy(LRUPolicy):
    """Evict the expert used least often since the start; ties go to the least recent.

    Counts survive eviction: a layer has few experts, and an expert's popularity is a
    property of the model more than of the moment.
    """

    def __init__(self):
        super().__init__()
        self._uses = {}

    def touch(self, expert: int):
        super().touch(expert)
        self._uses[expert] = self._uses.get(expert, 0) + 1

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        pinned = set(pinned)
        candidates = [e for e in self._order if e not in pinned]  # least recent first
        return min(candidates, key=self._uses.__getitem__, default=None)

    def heat(self, expert: int):
        return self._uses.get(expert, 0), self._last.get(expert, 0)


class LFUDAPolicy(LRUPolicy):
    """LFU with dynamic aging (Arlitt et al., 2000): an expert's key is its uses since
    it was loaded plus the key of the last victim, so that old popularity fades."""

    def __init__(self):
        super().__init__()
        self._key = {}
        self._age = 0

    def touch(self, expert: int):
        super().touch(expert)
        self._key[expert] = self._key.get(expert, self._age) + 1

    def forget(self, expert: int):
        super().forget(expert)
        if expert in self._key:
            self._age = self._key.pop(expert)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        pinned = set(pinned)
        candidates = [e for e in self._order if e not in pinned]
        return min(candidates, key=self._key.__getitem__, default=None)

    def heat(self, expert: int):
        """A resident's key; an absent expert's, were it loaded now."""
        return self._key.get(expert, self._age + 1)


class S3FIFOPolicy:
    """S3-FIFO (Yang et al., SOSP 2023): a small FIFO for new experts, a main FIFO for
    those used again, and a ghost list of recent evictions from the small one.

    The pool's size is not told to a policy; it is the number of experts tracked.
    """

    SMALL = 0.1  # share of the pool the small FIFO may hold
    MAX_FREQ = 3

    def __init__(self):
        self._small, self._main = OrderedDict(), OrderedDict()  # oldest first
        self._ghost = OrderedDict()
        self._freq = {}

    def touch(self, expert: int):
        if expert in self._freq:
            self._freq[expert] = min(self._freq[expert] + 1, self.MAX_FREQ)
            return
        self._freq[expert] = 0
        queue = self._main if self._ghost.pop(expert, False) is None else self._small
        queue[expert] = None

    def forget(self, expert: int):
        if self._freq.pop(expert, None) is None:
            return
        if self._small.pop(expert, False) is None:
            self._ghost[expert] = None
            while len(self._ghost) > max(len(self._main), 1):
                self._ghost.popitem(last=False)
        self._main.pop(expert, None)

    def victim(self, pinned: Iterable[int]) -> Optional[int]:
        pinned = set(pinned)
        order = [self._from_small, self._from_main]
        if len(self._small) < self.SMALL * len(self._freq):
            order.reverse()
        for evict_from in order:
            victim = evict_from(pinned)
            if victim is not None:  # expert 0 is a victim too
                return victim
        return None

    def _from_small(self, pinned) -> Optional[int]:
        for e in list(self._small):
            if e in pinned:
                continue
            if self._freq[e] > 1:  # used again while in the small FIFO: promote
                del self._small[e]
                self._main[e] = None
                self._freq[e] = 0
            else:
                return e
        return None

    def _from_main(self, pinned) -> Optional[int]:
        for _ in range(self.MAX_FREQ + 1):  # each pass lowers every frequency by one
            for e in list(self._main):
                if e in pinned:
                    continue
                if self._freq[e] == 0:
                    return e
                self._freq[e] -= 1
                self._main.move_to_end(e)
        return None


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


POLICIES = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "lfuda": LFUDAPolicy,
    "s3fifo": S3FIFOPolicy,
    "learned": LearnedPolicy.from_file,  # weights from DEFAULT_LEARNED unless given
}
DEFAULT_POLICY = "lfu"  # best online policy in cache_sim replays of the bundled model


def make_policy(name, learned=None):
    """A fresh policy by name (`learned`: the learned policy's weights file), or from a
    factory: a callable taking nothing."""
    if callable(name):
        return name()
    if name not in POLICIES:
        raise ValueError(f"cache policy {name!r}: choose one of {', '.join(POLICIES)}")
    if name == "learned":
        return LearnedPolicy.from_file(learned)
    return POLICIES[name]()
