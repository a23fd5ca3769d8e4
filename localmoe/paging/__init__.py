"""Expert residency: where each routed expert lives (disk, host RAM, GPU) and how it moves.

`provider_for_store(store, spec, config)` is what the loader calls for a packed store: an
`ExpertProvider` (engine/experts.py) that serves (layer, expert) requests from the store.
With `config.paging.ram_budget` 0 that is `StoreExperts` (maps of the store; the page cache
decides); otherwise a `Pager` over a RAM slab of that many bytes. See docs/paging.md.

    pager = make_pager(store, PagingConfig(ram_budget=2 << 30, policy="lfru"))
    model.use_experts(pager)
    attach(model, pager)          # routing hints: parallel loads + router lookahead
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from localmoe.config import PagingConfig
from localmoe.engine.experts import ExpertWeights, ResidentExperts
from localmoe.paging.disk import make_backend
from localmoe.paging.errors import PagingError
from localmoe.paging.hooks import attach, detach
from localmoe.paging.pager import Pager
from localmoe.paging.policy import make_policy, popularity
from localmoe.paging.slab import slots_for_budget
from localmoe.paging.stats import PagingStats
from localmoe.paging.trace import RoutingTrace

__all__ = [
    "Pager",
    "PagingConfig",
    "PagingStats",
    "RoutingTrace",
    "StoreExperts",
    "attach",
    "attach_provider",
    "detach",
    "expert_bytes",
    "make_pager",
    "provider_for_store",
]


class StoreExperts:
    """Every expert read straight from the store's maps (no budget: the page cache decides). A layer's experts are
    mapped together when the engine asks for its tables (`kernel_table`, `dense_table`, `block_table`, as
    `ResidentExperts` gives them), so each layer is handed to the kernels whole, routing inside their call, as a
    resident model's is: the same bits, the page cache's pages in place of the resident copy."""

    waits = True  # a page fault reads from disk (engine/experts.py ExpertProvider)

    def __init__(self, store):
        self.store = store
        self._layers: dict[int, ResidentExperts | None] = {}  # layer -> its experts' maps, once a table is asked

    def get(self, layer: int, expert: int) -> ExpertWeights:
        mapped = self._layers.get(layer)
        return mapped.get(layer, expert) if mapped is not None else \
            ExpertWeights.from_parts(self.store.expert(layer, expert))

    def form(self, layer: int) -> ExpertWeights:
        return self.get(layer, self.store.experts_in(layer)[0])

    def _mapped(self, layer: int) -> ResidentExperts | None:
        """The layer's experts, every one mapped (None where the ids are not 0..n-1: no whole table)."""
        if layer not in self._layers:
            ids = self.store.experts_in(layer)
            self._layers[layer] = None if ids != list(range(len(ids))) else ResidentExperts(
                {layer: [ExpertWeights.from_parts(self.store.expert(layer, e)) for e in ids]})
        return self._layers[layer]

    def kernel_table(self, layer: int):
        mapped = self._mapped(layer)
        return None if mapped is None else mapped.kernel_table(layer)

    def dense_table(self, layer: int):
        mapped = self._mapped(layer)
        return None if mapped is None else mapped.dense_table(layer)

    def block_table(self, layer: int):
        mapped = self._mapped(layer)
        return None if mapped is None else mapped.block_table(layer)

    def nbytes(self) -> int:
        return 0  # nothing held beyond the OS page cache


def expert_bytes(store) -> int:
    """Bytes of every routed-expert extent in `store`."""
    return sum(len(store.experts_in(layer)) * store.layout(layer).slot_bytes for layer in store.layers())


@dataclass(frozen=True)
class Profile:
    """A calibration profile (localmoe calibrate): (layer, expert, uses) hottest first, over `tokens` tokens."""

    ranking: list[tuple[int, int, int]]
    tokens: int

    def hot(self) -> list[tuple[int, int]]:
        return [(layer, e) for layer, e, _ in self.ranking]

    def lfru_prior(self) -> dict:
        """LFRU's options: each expert's uses per token, worth `tokens` passes of evidence (none without tokens)."""
        if self.tokens <= 0:
            return {}
        return {"popularity": popularity(self.ranking, self.tokens), "popularity_tokens": float(self.tokens)}


def load_profile(path: str | Path) -> Profile:
    """A calibration profile written by `localmoe calibrate`."""
    try:
        data = json.loads(Path(path).read_text())
        ranking = [(int(layer), int(e), int(c)) for layer, e, c in data["ranking"]]
        return Profile(ranking, int(data.get("tokens", 0)))
    except (OSError, ValueError, KeyError, TypeError, PagingError) as e:
        raise PagingError(f"{path}: not a localmoe calibration profile ({e}); write one with "
                          f"`localmoe calibrate`") from None


def make_pager(store, config: PagingConfig, dtype: str | None = None) -> Pager:
    """A Pager over `store` (a PackedStore) within `config.ram_budget` bytes; `dtype` (the engine's): its dense
    experts stored as a resident model stores them (Pager)."""
    slot_bytes = max(store.layout(layer).slot_bytes for layer in store.layers())
    slots = slots_for_budget(config.ram_budget, slot_bytes)
    if slots < 1:
        raise PagingError(f"--ram {config.ram_budget} bytes holds no expert slot: one expert of this model takes "
                          f"{slot_bytes} bytes ({slot_bytes / 2**20:.1f} MiB)")
    trace = RoutingTrace.load(config.trace).keys() if config.trace else None
    profile = load_profile(config.profile) if config.profile else None
    options = profile.lfru_prior() if profile is not None and config.policy == "lfru" else {}
    policy = make_policy(config.policy, trace=trace, **options)
    pinned = profile.hot() if profile is not None else ()
    return Pager(store, slots, policy, make_backend(config.io, store, config.verify), io_threads=config.io_threads,
                 timeout=config.timeout, pinned=pinned, prefetch=config.prefetch, dtype=dtype)


def gpu_tiers(config, slot_bytes: int) -> list:
    """One `GpuSlab` of `config.gpu_budget` bytes per visible CUDA device ([] when the budget is 0).

    A budget without CUDA is an error naming the flag, not a silent no-op."""
    if not config.gpu_budget:
        return []
    import torch

    from localmoe.paging.gpu import GpuSlab

    if not torch.cuda.is_available():
        raise PagingError(f"--gpu-mem {config.gpu_budget} bytes: this machine has no CUDA device; leave --gpu-mem "
                          f"at 0 (experts are then computed on the CPU where they sit)")
    return [GpuSlab(f"cuda:{i}", config.gpu_budget, slot_bytes) for i in range(torch.cuda.device_count())]


def attach_provider(model, provider, config) -> None:
    """What the loader does after building a model over a packed store's `provider`: a Pager gets
    its routing hooks (parallel loads, router lookahead, an optional trace) and, with --gpu-mem, its
    GPU tiers, placing by bandwidths measured now (placement.measure_devices)."""
    if not isinstance(provider, Pager):
        return
    slabs = gpu_tiers(config.paging, provider.slab.slot_bytes)
    attach(model, provider, lookahead=provider.prefetch_enabled, whole=not slabs)
    if slabs:
        from localmoe.paging.placement import measure_devices

        provider.use_gpus(slabs, measure_devices(provider.store, slabs[0].device))


def provider_for_store(store, spec, config):
    """The ExpertProvider the engine config asks for over `store` (a PackedStore).

    The loader then calls `attach_provider(model, provider, config)` once the model is built
    (parallel loads and router lookahead for a Pager; see docs/paging.md)."""
    paging = config.paging
    if paging.ram_budget == 0:
        if paging.gpu_budget:
            raise PagingError(f"--gpu-mem {paging.gpu_budget} bytes: the GPU tier is filled from the RAM tier; give "
                              f"--ram too (bytes, or a share of the experts such as 25%)")
        return StoreExperts(store)
    # (a GPU tier copies a slot's bytes as the store's layout has them: dense experts then keep the store's dtype)
    return make_pager(store, paging, None if paging.gpu_budget else config.dtype)
