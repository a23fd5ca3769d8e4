"""Prometheus export, the run --stats line, the placement cost model, the GPU slab."""

from __future__ import annotations

import re

import pytest
import torch

from localmoe.paging import PagingConfig, make_pager
from localmoe.paging.metrics import prometheus_text, stats_line
from localmoe.paging.placement import Bandwidths, place, predict_decode
from localmoe.paging.stats import PagingStats

from .conftest import run_greedy


def test_prometheus_text_reflects_the_counts(gpt_oss):
    pager = make_pager(gpt_oss.store(), PagingConfig(ram_budget=1 << 20, prefetch=False))
    gpt_oss.model.use_experts(pager)
    run_greedy(gpt_oss.model)
    text = prometheus_text(pager.stats)
    pager.close()
    line = re.compile(r'^(#.*|[a-z_]+(\{[a-z]+="[^"]*"(,[a-z]+="[^"]*")*\})? [-+0-9.e]+(inf)?)$')
    assert all(line.match(x) for x in text.strip().splitlines()), text
    hits = re.search(r'localmoe_paging_hits_total\{[^}]*tier="ram"\} (\d+)', text)
    assert int(hits.group(1)) == pager.stats.ram.hits
    assert "localmoe_paging_bytes_read_total" in text and "# TYPE localmoe_paging_hit_ratio gauge" in text
    assert stats_line(gpt_oss.model).startswith("[paging lfru/odirect")
    gpt_oss.restore()
    assert stats_line(gpt_oss.model) is None


def test_stats_ratios():
    s = PagingStats()
    s.ram.hits, s.ram.misses, s.ram.read_seconds, s.ram.stall_seconds = 3, 1, 2.0, 0.5
    s.prefetch.issued, s.prefetch.used, s.prefetch.covered, s.prefetch.uncovered = 4, 3, 3, 1
    assert (s.ram.hit_rate, s.ram.overlap, s.prefetch.precision, s.prefetch.recall) == (0.75, 0.75, 0.75, 0.75)
    assert s.to_dict()["tiers"]["ram"]["overlapped_seconds"] == 1.5


def test_placement_cpu_vs_gpu():
    slot = 6 << 20
    no_gpu = Bandwidths(disk=0.9e9, cpu_expert=0.3e9)
    assert place(slot, 1, no_gpu).where == "cpu"
    slow_bus = Bandwidths(disk=0.9e9, cpu_expert=10e9, pcie=1e9, gpu_expert=1e12)
    fast_bus = Bandwidths(disk=0.9e9, cpu_expert=1e9, pcie=25e9, gpu_expert=1e12)
    assert place(slot, 1, slow_bus).where == "cpu"  # copying costs more than computing where it is
    assert place(slot, 1, fast_bus).where == "gpu"
    assert place(slot, 1, slow_bus, on_gpu=True).where == "gpu"  # already there: no copy
    assert place(slot, 512, slow_bus).where == "gpu"  # prefill: the CPU's cost grows with tokens


def test_predicted_speed_moves_the_right_way():
    bw = Bandwidths(disk=0.9e9, cpu_expert=1e9)
    slow = predict_decode(48, 6 << 20, 0.25, bw)
    assert predict_decode(48, 6 << 20, 0.75, bw) > slow
    assert predict_decode(48, 6 << 20, 0.25, bw, overlap=0.8) > slow
    assert predict_decode(48, 6 << 20, 0.25, Bandwidths(disk=2e9, cpu_expert=1e9)) > slow


@pytest.mark.parametrize("device", ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else []))
def test_gpu_slab_roundtrip(gpt_oss, device):
    from localmoe.paging.gpu import GpuSlab

    store = gpt_oss.store()
    layer = store.layers()[0]
    layout = store.layout(layer)
    pager = make_pager(store, PagingConfig(ram_budget=1 << 20, prefetch=False))
    pager.get(layer, 0)
    host = pager.slab.slot_tensor(pager.where[(layer, 0)].index)
    gpu = GpuSlab(device, 4 * layout.slot_bytes, layout.slot_bytes)
    parts = gpu.load(1, host, layout)
    for name, t in store.expert(layer, 0).items():
        assert parts[name].device == torch.device(device)
        assert torch.equal(parts[name].cpu(), t)
    pager.close()
