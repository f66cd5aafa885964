"""Modes between exact and predicted routing (issue #52), as the frontier measures them
(scripts/frontier.py).

- cache-conditional routing (`ConditionalTap`): the heads' prediction is read a token
  ahead, as in the prerouted mode, but the native router still chooses, restricted to the
  experts its layer's slots hold or the heads predicted. The routing is exact whenever the
  router's top-k is among them; otherwise the best the router ranks among them. Here the
  slots are simulated (`SlotSim`: the store's own policy over the budget's slots), so that
  quality and bytes can be measured with every expert resident.
- per-layer fallback (`with_native_layers`): a copy of a heads folder whose config keeps
  the given layers on their router (PrerouterConfig.native_layers, which every tool reads).
  `route_by_recall` (`python -m edgemoe.routing.between`) chooses them from each layer's
  held-out recall and writes them, with cache-conditional routing for the others, into
  the heads' own config: the bundled pack's is its default of `--routing prerouted`.
- reduced top-k (`set_top_k`): the k most likely of the router's or the heads' logits,
  as Edge0 and flash-moe run (4 of 8).
"""

import json
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, Optional, Sequence, Set

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .gates import RouterTap, _linear_map
from .heads_config import CONFIG


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


def with_native_layers(heads: Path, layers: Iterable[int], out: Path) -> Path:
    """A copy of the heads folder `heads` in `out` whose config keeps `layers` native
    (beside those it keeps already)."""
    heads, out = Path(heads), Path(out)
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(heads, out)
    config = json.loads((out / CONFIG).read_text())
    config["native_layers"] = sorted(set(config.get("native_layers", [])) | set(layers))
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def plain_heads(heads: Path, out: Path) -> Path:
    """A copy of the heads folder `heads` in `out` routed plainly: every layer but the
    first by the heads, at the model's top-k (no per-layer fallback, reduced top-k or
    cache-conditional routing)."""
    out = with_native_layers(heads, [], out)
    config = json.loads((out / CONFIG).read_text())
    config.update(native_layers=sorted(config["native_layers"])[:1], route_top_k=0,
                  conditional=0)
    (out / CONFIG).write_text(json.dumps(config, indent=1))
    return out


def route_by_recall(heads: Path, min_recall: float, conditional: int) -> dict:
    """Set the heads folder's own routing (its prerouter_config.json, what `--routing
    prerouted` runs): the layers whose head recalls less than `min_recall` of the top-k on
    held-out text (its training report) keep their router; the others route
    cache-conditionally among the slots and the heads' `conditional` most likely (0:
    by the heads). Returns the config written."""
    heads = Path(heads)
    recall = layer_recall(heads / "report.json")
    if recall is None:
        raise FileNotFoundError(f"{heads / 'report.json'}: no such file; the heads' "
                                f"training report gives each layer's recall")
    config = json.loads((heads / CONFIG).read_text())
    first = sorted(set(config["native_layers"]))[:1]
    config["native_layers"] = sorted({*first, *(t for t, r in recall.items() if r < min_recall)})
    config["conditional"] = int(conditional)
    (heads / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    return config


def main(argv=None):
    import argparse

    p = argparse.ArgumentParser(description="Set a heads folder's routing from its layers' "
                                            "recall (route_by_recall)")
    p.add_argument("--heads", required=True, help="a prerouter heads folder")
    p.add_argument("--min-recall", type=float,
                   help="layers whose head recalls less keep their router (0.45)")
    p.add_argument("--conditional", type=int, default=0,
                   help="the others: the router among the slots and the heads' m most "
                        "likely (8); 0: routed by the heads")
    p.add_argument("--plain-copy", metavar="OUT",
                   help="instead, copy the heads to OUT routed plainly (every layer but "
                        "the first by the heads: the routing the CUDA backend runs)")
    args = p.parse_args(argv)
    if args.plain_copy:
        print(plain_heads(Path(args.heads), Path(args.plain_copy)))
        return
    if args.min_recall is None:
        p.error("--min-recall: expected a recall (0.45), found none")
    config = route_by_recall(Path(args.heads), args.min_recall, args.conditional)
    print(f"{args.heads}: native layers {config['native_layers']}, conditional "
          f"{config['conditional']}")


def layer_recall(report_path: Path) -> Optional[Dict[int, float]]:
    """Each target layer's held-out recall from a train_prerouter report.json."""
    path = Path(report_path)
    if not path.exists():
        return None
    report = json.loads(path.read_text())
    return {r["target"]: r["head"]["recall"] for r in report["layers"]}


def adapter_for_layers(adapter: Path, layers: Iterable[int], out: Path) -> Path:
    """A copy of the adapter folder `adapter` in `out` that adapts only the decoder layers
    `layers` (the others' tensors left out: their deltas stay zero, and their experts
    stream no delta records)."""
    adapter, out, keep = Path(adapter), Path(out), {int(l) for l in layers}
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    weights = mx.load(str(adapter / "adapters.safetensors"))
    mx.save_safetensors(str(out / "adapters.safetensors"),
                        {k: v for k, v in weights.items() if int(k.split(".")[2]) in keep})
    shutil.copy(adapter / "adapter_config.json", out / "adapter_config.json")
    return out


if __name__ == "__main__":
    main()
