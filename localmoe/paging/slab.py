"""Host-RAM tier: one page-aligned slab cut into fixed-size expert slots.

Every slot holds one whole extent (`slot_bytes`, a multiple of 4096), so an O_DIRECT read
lands in it directly and the tensors of the expert are zero-copy views of the slot. The
slab is allocated once, from the budget, and never grows: the budget is the slab. With
CUDA present it is pinned (page-locked), so copies to a GPU slot run at full PCIe speed.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

from localmoe.paging.errors import PagingError


def slots_for_budget(budget_bytes: int, slot_bytes: int) -> int:
    """How many slots of `slot_bytes` fit in `budget_bytes`."""
    return budget_bytes // slot_bytes


class HostSlab:
    """`num_slots` slots of `slot_bytes` bytes each, page-aligned, in one allocation."""

    def __init__(self, num_slots: int, slot_bytes: int, pin: bool | None = None):
        if num_slots < 1:
            raise PagingError(f"the RAM budget holds no expert slot of {slot_bytes} bytes; raise --ram to at "
                              f"least {slot_bytes} bytes ({slot_bytes / 2**20:.1f} MiB)")
        if slot_bytes <= 0 or slot_bytes % mmap.PAGESIZE:
            raise PagingError(f"slot size {slot_bytes} is not a positive multiple of the page size")
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        pin = torch.cuda.is_available() if pin is None else pin
        self.pinned = pin
        if pin:  # cudaHostAlloc: page-aligned and page-locked
            self._tensor = torch.empty(num_slots * slot_bytes, dtype=torch.uint8, pin_memory=True)
            self.array = self._tensor.numpy()
        else:  # an anonymous map: page-aligned, so O_DIRECT can read into any slot
            self._map = mmap.mmap(-1, num_slots * slot_bytes)
            self.array = np.frombuffer(self._map, dtype=np.uint8)
            self._tensor = torch.from_numpy(self.array)
        self.array[::mmap.PAGESIZE] = 0  # touch every page now: the slab is charged once, up front

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, i: int) -> np.ndarray:
        """Slot `i` as a uint8 array view (writable; O_DIRECT-aligned)."""
        return self.array[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def slot_tensor(self, i: int) -> torch.Tensor:
        return self._tensor[i * self.slot_bytes:(i + 1) * self.slot_bytes]
