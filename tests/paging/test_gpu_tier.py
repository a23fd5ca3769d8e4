"""GPU tiers: placement between copying an expert to its GPU and computing it on the CPU.

Every test runs on "cpu" slabs, a GPU tier whose device is the host: the tier's decisions, copies,
evictions, pins and the separate per-tier sums in engine/layers/moe.dispatch are the same code as on a GPU,
only the device differs. Where CUDA exists the same tests also run on "cuda:0".
"""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers.moe import MoEBlock
from localmoe.paging import PagingConfig, attach, make_pager
from localmoe.paging.errors import PagingError
from localmoe.paging.gpu import GpuSlab
from localmoe.paging.placement import Bandwidths, place

from .conftest import run_greedy

DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])
# no fixed per-expert GPU cost: the tiny experts' bytes alone decide
SLOW_BUS = Bandwidths(disk=1e9, cpu_expert=10e9, pcie=1e9, gpu_expert=1e12, gpu_overhead=0.0)  # decode stays on CPU
FAST_BUS = Bandwidths(disk=1e9, cpu_expert=1e9, pcie=50e9, gpu_expert=1e12, gpu_overhead=0.0)  # copying always pays


def _paged(c, bandwidths, device="cpu", gpus=1, gpu_slots=4, ram_slots=64, hot=(), prefetch=True):
    store = c.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    pager = make_pager(store, PagingConfig(ram_budget=ram_slots * slot, prefetch=prefetch, timeout=10))
    pager.hot = list(hot)
    pager.use_gpus([GpuSlab(device, gpu_slots * slot, slot) for _ in range(gpus)], bandwidths)
    c.model.use_experts(pager)
    attach(c.model, pager, lookahead=prefetch)
    return pager


def test_slow_bus_keeps_every_expert_on_the_cpu_bit_identical(gpt_oss):
    pager = _paged(gpt_oss, SLOW_BUS)
    try:
        tokens, logits = run_greedy(gpt_oss.model)
    finally:
        pager.close()
    assert tokens == gpt_oss.tokens
    assert all(torch.equal(a, b) for a, b in zip(logits, gpt_oss.logits))
    gpu = pager.stats.tiers["gpu0"]
    assert gpu.loads == gpu.hits == 0 and gpu.misses == pager.stats.computed["ram"] > 0
    assert set(pager.stats.computed) == {"ram"}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gpus,gpu_slots", [(1, 2), (2, 3), (1, 64)])
def test_fast_bus_computes_every_expert_on_its_gpu(gpt_oss, device, gpus, gpu_slots):
    pager = _paged(gpt_oss, FAST_BUS, device, gpus, gpu_slots)
    try:
        tokens, logits = run_greedy(gpt_oss.model)
    finally:
        pager.close()
    # each expert's contribution is the same computation; only the order of the final sum differs
    # (a GPU tier's sum is added to the host's at the end); on CUDA the Triton kernel computes them
    tol = 1e-5 if device == "cpu" else 1e-3
    for a, b in zip(logits, gpt_oss.logits):
        span = (b.max() - b.min()).item()
        assert (a - b).abs().max().item() <= tol * span
    if device == "cpu":
        assert tokens == gpt_oss.tokens
    stats = pager.stats
    names = [f"gpu{i}" for i in range(gpus)]
    assert set(stats.computed) == set(names)  # nothing stayed on the CPU
    for name in names:
        t = stats.tiers[name]
        assert t.requests == stats.computed[name] > 0
        assert t.loads == t.misses and t.bytes_read == t.loads * stats.slot_bytes
        assert t.evictions == max(0, t.loads - gpu_slots)
        layers = [b.layer for b in gpt_oss.model.moe_blocks()]
        mine = [layer for layer in layers if pager.gpu.name_of(layer) == name]
        assert mine == sorted(mine) and len(mine) == len(layers) // gpus  # contiguous runs of layers
    if gpu_slots == 64:  # every expert fits: each was copied once, later passes hit
        assert all(stats.tiers[n].loads <= 32 for n in names)
        assert sum(stats.tiers[n].hits for n in names) > 0


def test_gpu_held_experts_are_not_read_from_disk_again(gpt_oss):
    pager = _paged(gpt_oss, FAST_BUS, gpu_slots=64)
    try:
        run_greedy(gpt_oss.model)
        held = set(pager.gpu.where)
        ram_loads = pager.stats.ram.loads
        run_greedy(gpt_oss.model)  # same prompt, same routing: every expert is on the GPU now
    finally:
        pager.close()
    assert held and pager.stats.ram.loads == ram_loads
    assert pager.stats.tiers["gpu0"].loads == len(held)


def test_placement_follows_the_token_count(gpt_oss):
    """At decode a slow bus keeps a host expert on the CPU; a prefill-sized batch copies it over."""
    pager = _paged(gpt_oss, SLOW_BUS)
    layer = pager.store.layers()[0]
    slot = pager.layouts[layer].slot_bytes
    try:
        assert place(slot, 1, SLOW_BUS).where == "cpu" and place(slot, 512, SLOW_BUS).where == "gpu"
        w, tier = pager.placed(layer, 3, tokens=1)
        assert tier == "ram" and (layer, 3) not in pager.gpu
        w2, tier = pager.placed(layer, 3, tokens=512)
        assert tier == "gpu0" and (layer, 3) in pager.gpu
        for p in ("gate", "up", "down"):
            assert torch.equal(getattr(w2, p).packed.cpu(), getattr(w, p).packed)
        _, tier = pager.placed(layer, 3, tokens=1)  # now it is there: no copy, compute it there
        assert tier == "gpu0" and pager.stats.tiers["gpu0"].hits == 1
    finally:
        pager.close()


def test_profile_pins_the_hottest_experts_on_the_gpu(gpt_oss):
    layers = gpt_oss.store().layers()
    hot = [(layers[0], e) for e in (5, 1, 7, 2)] + [(layers[1], 0)]
    pager = _paged(gpt_oss, FAST_BUS, gpu_slots=4, hot=hot)
    try:
        assert pager.gpu.pinned == {(layers[0], 5), (layers[0], 1)}  # at most half the slots
        assert pager.stats.tiers["gpu0"].loads == 0 and pager.stats.ram.loads == 0  # preload not counted
        run_greedy(gpt_oss.model)
        assert pager.gpu.pinned <= set(pager.gpu.where)  # never evicted
        assert pager.stats.tiers["gpu0"].evictions > 0
    finally:
        pager.close()


def test_dispatch_adds_a_gpu_tiers_sum_to_the_hosts(gpt_oss):
    """One layer with some experts on the CPU and some in a GPU tier equals the resident layer."""
    pager = _paged(gpt_oss, SLOW_BUS, gpu_slots=8)
    block: MoEBlock = gpt_oss.model.moe_blocks()[0]
    x = torch.randn(1, 5, block.router.linear.weight.shape[1])
    try:
        _, ids = block.router(x.reshape(-1, x.shape[-1]))
        for e in ids.unique().tolist()[::2]:  # every other chosen expert goes to the GPU tier
            pager.placed(block.layer, e, tokens=512)
        mixed = block(x)
        assert set(pager.stats.computed) == {"ram", "gpu0"}
    finally:
        pager.close()
        gpt_oss.restore()
    torch.testing.assert_close(mixed, block(x), rtol=1e-5, atol=1e-6)


def test_gpu_mem_needs_a_ram_tier_and_a_store(gpt_oss, tmp_path):
    from localmoe.config import EngineConfig
    from localmoe.errors import LocalMoEError
    from localmoe.load import load_model

    with pytest.raises(PagingError, match="--ram"):
        load_model(gpt_oss.store_path, EngineConfig(paging=PagingConfig(gpu_budget=1 << 30)), progress=False)
    with pytest.raises(LocalMoEError, match="packed store"):
        load_model(gpt_oss.src, EngineConfig(paging=PagingConfig(gpu_budget=1 << 30)), progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(PagingError, match="no CUDA"):
            load_model(gpt_oss.store_path, EngineConfig(paging=PagingConfig(gpu_budget=1 << 30, ram_budget=1 << 30)), progress=False)


def test_gpu_stats_reach_the_summary_and_prometheus(gpt_oss):
    from localmoe.paging.metrics import prometheus_text

    pager = _paged(gpt_oss, FAST_BUS)
    try:
        run_greedy(gpt_oss.model, steps=2)
    finally:
        pager.close()
    assert "gpu0:" in pager.stats.summary() and "computed: gpu0" in pager.stats.summary()
    text = prometheus_text(pager.stats)
    assert f'localmoe_paging_computed_total{{policy="lfru",backend="odirect",tier="gpu0"}} ' \
           f'{pager.stats.computed["gpu0"]}' in text
    assert 'tier="gpu0"} ' in text
