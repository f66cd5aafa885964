"""The budget rules, in one place: what a slot costs, how many a budget buys, the minimum.

A slot holds one expert record. Every MoE layer gets the same number of slots, so one
"slot" of budget is one record in every layer: `slot_bytes` is the sum of the layers'
record sizes. A budget buys `budget // slot_bytes` slots per layer, at most the
experts of the smallest layer; the minimum is top-k slots (one token's experts) in
every layer. The store, `doctor`, `cache_sim`, the engine's `/metrics` and the
benchmarks all size pools with `SlotPlan`, so they cannot disagree.

The budget "auto" is what fits in the memory available (`auto_budget_bytes`): the memory
less a share left free, the runtime, the resident weights and a KV cache of
AUTO_KV_TOKENS tokens. `load` and `doctor` use the same rule.
"""

import re
import sys
from dataclasses import dataclass
from typing import Optional, Sequence, Union

Budget = Union[None, int, float, str]

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
_HELP = "a fraction like 0.25, a percentage like 25%, a size like 2GB, or auto"
AUTO = "auto"
HEADROOM = 0.10  # of the memory, left to the OS, activations and other programs
RUNTIME_BYTES = 512 * 2**20  # Python, MLX and the tokenizer (about 0.3 GB RSS here)
AUTO_KV_TOKENS = 4096  # the context the KV cache is given room for (or the model's, if less)


class BudgetError(ValueError):
    pass


def parse_budget(budget: Budget, total_bytes: int) -> int:
    """Bytes for a budget given as a fraction (0.25, "25%"), a byte count or "2GB".

    Over 100% means all experts (with a note on stderr). A bare number with a
    fractional part above 1 ("1.5") is neither a fraction nor a byte count: an error.
    """
    if budget is None:
        return total_bytes
    if isinstance(budget, str):
        text = budget.strip().upper()
        if text.endswith("%"):
            try:
                percent = float(text[:-1])
            except ValueError:
                raise BudgetError(f"expert budget {budget!r}: expected {_HELP}") from None
            if percent > 100:
                print(f"[edgemoe] expert budget {budget}: more than all experts; holding "
                      f"all of them (100%)", file=sys.stderr)
                percent = 100
            return parse_budget(percent / 100, total_bytes)
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*([A-Z]*)", text)
        if not m or m.group(2) not in _UNITS:
            raise BudgetError(f"expert budget {budget!r}: expected {_HELP}")
        value, unit = float(m.group(1)), m.group(2)
        if not unit:
            if value <= 1:
                return parse_budget(value, total_bytes)
            if not value.is_integer():
                raise BudgetError(f"expert budget {budget!r}: a fraction is at most 1 (1.0 "
                                  f"holds every expert); for more write a size like "
                                  f"{budget}GB, or 100%")
        return int(value * _UNITS[unit])
    if budget <= 0:
        raise BudgetError(f"expert budget {budget!r} must be positive")
    if budget <= 1:  # a fraction; no budget is a single byte
        return int(budget * total_bytes)
    if isinstance(budget, float) and not budget.is_integer():
        raise BudgetError(f"expert budget {budget!r}: a fraction is at most 1; a byte count "
                          f"is a whole number")
    return int(budget)


def auto_budget_bytes(total_bytes: int, minimum: int, resident_bytes: int, kv_bytes: int,
                      memory_bytes: int) -> int:
    """The expert budget that fits in `memory_bytes` (see the module doc); a BudgetError
    naming every share when even the minimum does not."""
    room = int(memory_bytes * (1 - HEADROOM)) - RUNTIME_BYTES - resident_bytes - kv_bytes
    if room < minimum:
        raise BudgetError(
            f"the model does not fit in {fmt_bytes(memory_bytes)} of available memory: it "
            f"needs the resident weights {fmt_bytes(resident_bytes)} + a KV cache of "
            f"{fmt_bytes(kv_bytes)} + the minimum expert budget {fmt_bytes(minimum)} + the "
            f"runtime {fmt_bytes(RUNTIME_BYTES)}, with {HEADROOM:.0%} kept free")
    return min(room, total_bytes)


def fitting_budget(pack, config: dict, memory_bytes: Optional[int] = None,
                   resident_bytes: Optional[int] = None,
                   model_args: Optional[dict] = None) -> int:
    """`--expert-budget auto` for a Pack: the bytes that fit in `memory_bytes` (default:
    what is available now, edgemoe.streaming.telemetry) beside `resident_bytes` (default:
    the pack's resident weights as stored; the CUDA backend holds them dequantized) and a
    KV cache sized by `config`, read as the family's `model_args` read it (its defaults:
    edgemoe.mlx_backend.families.model_args)."""
    from ..format.families import kv_bytes_per_token
    from .telemetry import available_memory_bytes

    plan = SlotPlan.of(pack)
    memory = available_memory_bytes() if memory_bytes is None else memory_bytes
    resident = pack.resident_bytes if resident_bytes is None else resident_bytes
    tokens = min(AUTO_KV_TOKENS, int(config.get("max_position_embeddings") or AUTO_KV_TOKENS))
    return auto_budget_bytes(plan.total_bytes, plan.minimum_bytes, resident,
                             tokens * kv_bytes_per_token(config, model_args), memory)


def is_auto(budget: Budget) -> bool:
    return isinstance(budget, str) and budget.strip().lower() == AUTO


@dataclass(frozen=True)
class SlotPlan:
    """The MoE layers' record sizes and expert counts, and what a budget buys of them."""

    expert_bytes: Sequence[int]  # one expert record, per MoE layer
    num_experts: Sequence[int]  # per MoE layer: those this host holds (all, on one host)
    top_k: int

    @classmethod
    def of(cls, pack) -> "SlotPlan":
        """The plan of a Pack (anything with `layers` and `top_k`). A host of several
        (edgemoe.distributed) plans for its own share: a percentage is of its experts, and
        a token may route all its top-k to them."""
        owned = tuple(getattr(l, "num_owned", l.num_experts) for l in pack.layers)
        return cls(tuple(l.expert_bytes for l in pack.layers), owned,
                   min(pack.top_k, *owned) if owned else pack.top_k)

    @property
    def slot_bytes(self) -> int:
        """One slot in every MoE layer."""
        return sum(self.expert_bytes)

    @property
    def total_bytes(self) -> int:
        """Every routed expert (payload, without alignment padding)."""
        return sum(b * n for b, n in zip(self.expert_bytes, self.num_experts))

    @property
    def minimum_bytes(self) -> int:
        """top-k slots in every MoE layer: one token's experts."""
        return self.top_k * self.slot_bytes

    def budget_bytes(self, budget: Budget) -> int:
        return parse_budget(budget, self.total_bytes)

    def slots_for_bytes(self, budget_bytes: int) -> int:
        """Slots per layer a byte budget buys (may be below top-k: see `slots`)."""
        return min(budget_bytes // self.slot_bytes, min(self.num_experts))

    def slots(self, budget: Budget) -> int:
        """Slots per layer for a budget; a BudgetError below the minimum."""
        budget_bytes = self.budget_bytes(budget)
        if budget_bytes < self.minimum_bytes:
            raise BudgetError(
                f"expert budget {fmt_bytes(budget_bytes)} cannot hold one layer's "
                f"top-{self.top_k} experts in every MoE layer; the minimum is "
                f"{fmt_bytes(self.minimum_bytes)} ({self.minimum_bytes} bytes, "
                f"{self.minimum_bytes / self.total_bytes:.1%} of the routed experts)")
        return self.slots_for_bytes(budget_bytes)

    def memory(self, slots: int) -> int:
        """Bytes the slot pools hold at `slots` per layer."""
        return slots * self.slot_bytes


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000


def minimum_bytes(pack) -> int:
    """The minimum budget of a Pack: top-k slots in every MoE layer."""
    return SlotPlan.of(pack).minimum_bytes
