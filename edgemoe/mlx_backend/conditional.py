"""Modes between exact and predicted routing (issue #52), as the frontier measures them
(scripts/frontier.py).

- cache-conditional routing (`ConditionalTap`): the heads' prediction is read a token
  ahead, as in the prerouted mode, but the native router still chooses, restricted to the
  experts its layer's slots hold or the heads predicted. The routing is exact whenever the
  router's top-k is among them; otherwise the best the router ranks among them. Here the
  slots are simulated (`SlotSim`: the store's own policy over the budget's slots), so that
  quality and bytes can be measured with every expert resident.
- per-layer fallback: edgemoe.routing.between writes it into a heads folder's config
  (backend-free; `python -m edgemoe.routing.between`).
- reduced top-k (`set_top_k`): the k most likely of the router's or the heads' logits,
  as Edge0 and flash-moe run (4 of 8): in any routing mode by `--experts-per-token`
  (`reduce_top_k`, at load), or by heads (their config's `route_top_k`).
"""

from typing import Callable, Dict, Iterable, Optional, Sequence, Set

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .gates import RouterTap, _linear_map, top_k as routed_k


class SlotSim:
    """One layer's slots as the store keeps them: `slots` experts, evicted by the cache
    policy (LFU by default), never one the current token needs. Counts what it loads."""

    def __init__(self, slots: int, policy):
        """`policy`: a fresh cache policy (edgemoe.streaming.cache.make_policy), the store's."""
        self.slots, self.policy = slots, policy
        self.resident: Set[int] = set()
        self.loads = self.tokens = 0

    def step(self, needed: Sequence[int]):
        """One token needs `needed` in slots (its experts in routing order, then what was
        read for it), in the store's order: every one touched, then the missing loaded."""
        needed = list(dict.fromkeys(needed))
        missing = [e for e in needed if e not in self.resident]
        for expert in needed:
            self.policy.touch(expert)
        for expert in reversed(missing):
            while len(self.resident) >= max(self.slots, len(needed)):
                victim = self.policy.victim(needed)
                if victim is None:
                    break
                self.resident.discard(victim)
                self.policy.forget(victim)
            self.resident.add(expert)
            self.loads += 1
        self.tokens += 1


class ConditionalTap(RouterTap):
    """A router map whose logits are the native ones restricted to the experts in slots
    (`sim`) or among the `predicted` most likely of the heads' prediction for this token
    (set by PreroutedPredictor as the prerouted mode's routing). Rows without a prediction
    (a sequence's first token) route natively. `exact` counts tokens whose native top-k
    was available."""

    def __init__(self, native: nn.Module, top_k: int, sim: SlotSim, predicted: int):
        super().__init__(native)
        self.top_k, self.sim, self.predicted = top_k, sim, predicted
        self.exact = self.tokens = 0

    def __call__(self, x: mx.array):
        if not self.pending[1]:  # logits given as the routing (indices_from_logits)
            return super().__call__(x)
        if self.hands_to is not None:
            self.hands_to.x = x
        (prediction, _), native = self.pending, self.logits(x)
        self.call = type(self.call)(recorded=native)
        if prediction is None:
            return native
        prediction = prediction.reshape(*native.shape)
        mx.eval(native, prediction)
        mask = self._mask(np.array(native, dtype=np.float32).reshape(-1, native.shape[-1]),
                          np.array(prediction, dtype=np.float32).reshape(-1, native.shape[-1]))
        return native + mx.array(mask.reshape(native.shape)).astype(native.dtype)

    def _mask(self, native: np.ndarray, predicted: np.ndarray) -> np.ndarray:
        """Per row, 0 for the experts the router may choose, -inf for the others; the
        slots advance token by token as they would have."""
        mask = np.zeros_like(native)
        k = self.top_k
        for row in range(len(native)):
            best = set(np.argpartition(-native[row], k)[:k].tolist())
            if np.isnan(predicted[row]).any():  # no prediction: native
                chosen, ahead = best, set()
            else:
                ahead = set(np.argpartition(-predicted[row], self.predicted)[:self.predicted]
                            .tolist())
                allowed = np.fromiter(self.sim.resident | ahead, dtype=np.int64)
                mask[row] = -np.inf
                mask[row, allowed] = 0.0
                scores = native[row, allowed]
                chosen = set(allowed[np.argpartition(-scores, k)[:k]].tolist())
            self.exact += chosen == best
            self.tokens += 1
            self.sim.step(list(chosen) + list(ahead))  # the prediction was read, chosen or not
        return mask


def install_conditional(predictor, blocks: Dict[int, nn.Module], slots: int,
                        predicted: int, new_policy: Callable) -> Dict[int, ConditionalTap]:
    """Make a PreroutedPredictor's layers route conditionally: each predicted layer's tap
    becomes a ConditionalTap over simulated slots (`new_policy()`: a fresh cache policy, the
    store's); the host no longer takes a prediction as a decode step's routing (the router
    decides)."""
    taps = {}
    for layer, tap in list(predictor.taps.items()):
        owner, name, _ = _linear_map(blocks[layer])
        top_k = int(getattr(blocks[layer], "top_k"))
        new = ConditionalTap(tap.native, top_k, SlotSim(slots, new_policy()), predicted)
        new.hands_to = tap.hands_to
        setattr(owner, name, new)
        predictor.taps[layer] = taps[layer] = new
    predictor.fixes = set()
    return taps


def set_top_k(blocks: Iterable[nn.Module], k: int):
    """Route each block to its `k` most likely experts (families with a `top_k` field)."""
    for block in blocks:
        if not hasattr(block, "top_k"):
            raise ValueError(f"{type(block).__name__}: no top_k field to reduce")
        block.top_k = k


def experts_per_token(blocks: Dict[int, nn.Module]) -> int:
    """The experts each token routes to now: the blocks' `top_k` field, or their
    `num_experts_per_tok`, or what their own code routes to (families with neither)."""
    first = blocks[min(blocks)]
    for name in ("top_k", "num_experts_per_tok"):
        if isinstance(getattr(first, name, None), int):
            return int(getattr(first, name))
    return routed_k(first)


def reduce_top_k(blocks: Dict[int, nn.Module], k: Optional[int]) -> int:
    """Route every block to its `k` most likely experts (`--experts-per-token`; None: the
    model's own k, unchanged). Returns the model's own k. A k above it, or a family whose
    blocks have no `top_k` field, is a ValueError naming the field."""
    own = experts_per_token(blocks)
    if k is None:
        return own
    first = blocks[min(blocks)]
    if not hasattr(first, "top_k"):
        raise ValueError(f"experts_per_token: expected MoE blocks with a top_k field to "
                         f"reduce, found {type(first).__name__} without one (this family "
                         f"routes to its own {own})")
    if not 1 <= k <= own:
        raise ValueError(f"experts_per_token: expected 1 to the model's own {own}, found {k}")
    set_top_k(blocks.values(), k)
    return own
