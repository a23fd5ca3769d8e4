"""GPU tiers: expert slots on each GPU, filled from the host slab, where experts are then computed.

`GpuSlab(device, budget_bytes, slot_bytes)` allocates one block of device slots once;
`load(i, host, layout)` copies one expert's slot bytes into slot `i` and returns its weights
as views of the slot. `GpuTier` decides which expert sits in which slot of which GPU: the MoE
layers are split into contiguous runs, one per device (a layer's tokens then cross to one
device once), and each device evicts by its own policy. `Pager.placed` asks it first and,
where the expert is not there, lets the cost model (placement.place) choose between copying
it over and computing it on the CPU where it sits.

A slab works on any torch device. The CLI makes CUDA slabs only (`paging.gpu_tiers`); the tests
also run the whole tier on "cpu" slabs, which exercises every decision and the separate sums
of engine/layers/moe.dispatch without a GPU.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from localmoe.engine.experts import ExpertWeights
from localmoe.paging.errors import PagingError
from localmoe.paging.policy import Key, make_policy
from localmoe.paging.stats import PagingStats, TierStats


class GpuSlab:
    """`num_slots` expert slots of `slot_bytes` on `device`, in one allocation."""

    def __init__(self, device: str | torch.device, budget_bytes: int, slot_bytes: int):
        self.device = torch.device(device)
        self.slot_bytes = slot_bytes
        self.num_slots = budget_bytes // slot_bytes
        if self.num_slots < 1:
            raise PagingError(f"--gpu-mem {budget_bytes} bytes holds no expert slot of {slot_bytes} bytes "
                              f"({slot_bytes / 2**20:.1f} MiB)")
        self.memory = torch.empty(self.num_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot(self, i: int) -> torch.Tensor:
        return self.memory[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def load(self, i: int, host: torch.Tensor, layout) -> dict[str, torch.Tensor]:
        """Copy `host` (uint8 slot bytes; pinned on a CUDA machine) into slot `i`; the parts over it.

        On CUDA the copy runs on a side stream that first waits for the compute stream, so kernels
        still reading the slot's previous expert finish before it is overwritten, and the compute
        stream waits for the copy. The host waits too: the pager may refill the host slot from disk
        as soon as this returns."""
        dst = self.slot(i)[:host.numel()]
        if self.stream is None:
            dst.copy_(host)
        else:
            compute = torch.cuda.current_stream(self.device)
            self.stream.wait_stream(compute)
            with torch.cuda.stream(self.stream):
                dst.copy_(host, non_blocking=True)
            compute.wait_stream(self.stream)
            self.stream.synchronize()
        return layout.views(dst)


class _Resident:
    __slots__ = ("device", "slot", "weights")

    def __init__(self, device: int, slot: int, weights: ExpertWeights):
        self.device, self.slot, self.weights = device, slot, weights


class GpuTier:
    """Experts held in the slabs of one or more GPUs (tier names "gpu0", "gpu1", ...).

    `layers` (the model's MoE layer indices) are split into len(slabs) contiguous runs, run i on
    slab i. Each slab evicts by its own `policy` (a Belady run uses LFRU here: its oracle follows
    the RAM tier's access sequence, not a GPU's). Counts go to `stats.tiers[name]`: a request is an
    expert computed for a layer of that GPU; a hit found it there; loads/bytes_read are copies in,
    stall_seconds the time the compute thread waited for them."""

    def __init__(self, slabs: Sequence[GpuSlab], layers: Sequence[int], policy: str, stats: PagingStats):
        if not slabs:
            raise PagingError("a GPU tier needs at least one GPU slab")
        self.slabs = list(slabs)
        self.names = [f"gpu{i}" for i in range(len(slabs))]
        ordered = sorted(layers)
        self.device_of = {layer: i * len(slabs) // len(ordered) for i, layer in enumerate(ordered)}
        name = "lfru" if policy == "belady" else policy
        self.policies = [make_policy(name) for _ in slabs]
        self.free = [list(reversed(range(s.num_slots))) for s in slabs]
        self.where: dict[Key, _Resident] = {}
        self.pinned: set[Key] = set()
        self.stats = stats
        for n in self.names:
            stats.tiers[n] = TierStats()

    def __contains__(self, key: Key) -> bool:
        return key in self.where

    def name_of(self, layer: int) -> str:
        return self.names[self.device_of[layer]]

    def lookup(self, key: Key, step: int) -> ExpertWeights | None:
        """The expert's weights on its GPU, or None (a miss); either way a request of that GPU."""
        d = self.device_of[key[0]]
        tier = self.stats.tiers[self.names[d]]
        found = self.where.get(key)
        if found is None:
            tier.misses += 1
        else:
            tier.hits += 1
            self.policies[d].access(key, step)
        return None if found is None else found.weights

    def load(self, key: Key, host: torch.Tensor, layout, step: int) -> ExpertWeights | None:
        """Copy the expert from its host bytes `host` into its GPU, evicting that GPU's policy victim;
        None where every slot there is pinned."""
        d = self.device_of[key[0]]
        slot = self._allocate(d, step)
        if slot is None:
            return None
        started = time.perf_counter()
        weights = ExpertWeights.from_parts(self.slabs[d].load(slot, host[:layout.slot_bytes], layout))
        waited = time.perf_counter() - started
        tier = self.stats.tiers[self.names[d]]
        tier.loads += 1
        tier.bytes_read += layout.slot_bytes
        tier.stall_seconds += waited
        tier.read_seconds += waited
        self.where[key] = _Resident(d, slot, weights)
        self.policies[d].insert(key, step)
        self.policies[d].access(key, step)
        return weights

    def pin(self, key: Key) -> None:
        self.pinned.add(key)

    def room_to_pin(self, layer: int) -> bool:
        """Whether the GPU of `layer` may pin one more expert (pins take at most half its slots)."""
        d = self.device_of[layer]
        pinned_here = sum(1 for k in self.pinned if self.device_of[k[0]] == d)
        return pinned_here < self.slabs[d].num_slots // 2

    def _allocate(self, d: int, step: int) -> int | None:
        if self.free[d]:
            return self.free[d].pop()
        candidates = [k for k, r in self.where.items() if r.device == d and k not in self.pinned]
        if not candidates:
            return None
        victim = self.policies[d].victim(candidates, step)
        self.policies[d].evict(victim)
        self.stats.tiers[self.names[d]].evictions += 1
        return self.where.pop(victim).slot

    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slabs)
