"""GPU tier: a slab of device expert slots per GPU, filled from the (pinned) host slab.

`GpuSlab(device, budget_bytes, slot_bytes)` allocates once; `load(slot, host_tensor)` copies
one expert's slot bytes on a side stream (non-blocking from pinned memory) and returns the
device tensors through the store layout. Which experts go there is `placement.place`'s
decision. The CPU engine computes on host tensors, so the pager does not use this tier until
the engine runs experts on CUDA; the class is tested where CUDA exists (skipped otherwise).
"""

from __future__ import annotations

import torch

from localmoe.paging.errors import PagingError


class GpuSlab:
    def __init__(self, device: str | torch.device, budget_bytes: int, slot_bytes: int):
        if not torch.cuda.is_available():
            raise PagingError("--gpu-mem needs CUDA, which this machine does not have")
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.num_slots = budget_bytes // slot_bytes
        if self.num_slots < 1:
            raise PagingError(f"--gpu-mem {budget_bytes} bytes holds no expert slot of {slot_bytes} bytes")
        self.memory = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device)

    def slot(self, i: int) -> torch.Tensor:
        return self.memory[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def load(self, i: int, host: torch.Tensor, layout) -> dict[str, torch.Tensor]:
        """Copy `host` (uint8 slot bytes, pinned for overlap) into slot `i`; tensors over it."""
        dst = self.slot(i)[:host.numel()]
        with torch.cuda.stream(self.stream):
            dst.copy_(host, non_blocking=True)
        torch.cuda.current_stream(self.device).wait_stream(self.stream)
        out = {}
        for p in layout.parts:
            out[p.name] = dst[p.offset:p.offset + p.nbytes].view(p.dtype).reshape(p.shape)
        return out
