"""Where a layer's slots keep their bytes: a backend's SlotMemory, the seam between the
slot state machine (edgemoe.streaming.slots) and the hardware.

MLX arrays in unified memory (edgemoe.mlx_backend.slots), device tensors filled from pinned
host rows (edgemoe.cuda.slots), or nothing at all (NoMemory: edgemoe.whatif.replay
runs traces through the state machine alone). This module needs neither MLX nor PyTorch.
"""

from typing import Callable, Dict, List, Optional, Protocol

import numpy as np

from ..format.pack import PackLayer


class SlotMemory(Protocol):
    """The bytes of one layer's slots, and the ordering a device needs around them.

    `arrays` are what compute reads: tensor name -> (num_slots, *shape). When a slot is
    claimed for an expert, `stage(slot, expert)` says where the reader writes its record
    (host buffers, in the layer's tensor order), or None when the memory already holds
    the record in a host tier (then the fill is a copy, not a read). The reader calls
    `before_read(slot)`, writes the buffers, then calls `after_read(slot)`; a slot turns
    ready only after that (a fill served from the host tier gets `after_read` alone). A
    fill that fails gets `abandon(slot)` instead. `has_room(expert)` is False while the
    memory cannot stage that expert now (its host rows are all being read into);
    `has_room_for(experts)`, whether it can stage them all, one after another. Compute
    calls `acquire(slots)` before reading slots and `release(slots)` once its reads are
    issued; a slot is refilled only after its release.
    """

    arrays: Dict[str, object]

    def stage(self, slot: int, expert: int) -> Optional[List[np.ndarray]]: ...

    def has_room(self, expert: int) -> bool: ...

    def has_room_for(self, experts: list) -> bool: ...

    def before_read(self, slot: int) -> None: ...

    def after_read(self, slot: int) -> None: ...

    def abandon(self, slot: int) -> None: ...

    def acquire(self, slots: List[int]) -> None: ...

    def release(self, slots: List[int]) -> None: ...


class UnorderedMemory:
    """Slot memory that the reader fills in place (`rows(slot)`), and whose reads and
    compute need no ordering hooks (host memory, where compute finishes its reads before
    it releases slots)."""

    def stage(self, slot: int, expert: int) -> List[np.ndarray]:
        return self.rows(slot)

    def has_room(self, expert: int) -> bool:
        return True

    def has_room_for(self, experts: list) -> bool:
        return True

    def before_read(self, slot: int):
        pass

    def after_read(self, slot: int):
        pass

    def abandon(self, slot: int):
        pass

    def acquire(self, slots: List[int]):
        pass

    def release(self, slots: List[int]):
        pass


class NoMemory(UnorderedMemory):
    """Slot memory that holds nothing: the state machine alone (trace replays)."""

    arrays: Dict[str, object] = {}

    def rows(self, slot: int) -> List[np.ndarray]:
        return []


# makes a layer's slot memory: (layer, number of slots) -> SlotMemory
MemoryFactory = Callable[[PackLayer, int], SlotMemory]
