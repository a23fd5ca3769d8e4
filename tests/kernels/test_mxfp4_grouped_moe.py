"""grouped_moe: a layer's MXFP4 experts in three grouped Triton calls (the GPU path of `mxfp4_moe`) against
the reference's per-expert loop, with experts laid out as a GPU slab lays them (views at a regular stride
of one allocation: stacked without a copy) and as separate tensors (stacked by copy), and without a host
sync between the calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from localmoe.kernels.mxfp4_moe import ExpertTable, naive_mxfp4_moe
from localmoe.kernels.mxfp4_moe import grouped_moe as gm

from .conftest import TRITON_DEVICES, assert_close
from .test_mxfp4_moe import _NoSync
from .test_mxfp4_moe_layer import _experts, _routing

E, D, I = 6, 64, 32


def on_slab(experts: dict, slot_bytes: int = 3 * 4096) -> dict:
    """The experts copied into one uint8 allocation, one slot of `slot_bytes` each (parts at the same offsets
    in every slot, as paging/gpu.py's GpuSlab and the store layout place them), as views of it."""
    memory = torch.zeros(len(experts) * slot_bytes, dtype=torch.uint8)
    out = {}
    for slot, (e, w) in enumerate(sorted(experts.items())):
        at = slot * slot_bytes

        def place(t: torch.Tensor) -> torch.Tensor:
            nonlocal at
            raw = t.contiguous().view(torch.uint8).reshape(-1)
            memory[at:at + raw.numel()] = raw
            view = memory[at:at + raw.numel()].view(t.dtype).view(t.shape)
            at += -(-raw.numel() // 16) * 16
            return view

        out[e] = SimpleNamespace(**{p: SimpleNamespace(packed=place(getattr(w, p).packed),
                                                       scales=place(getattr(w, p).scales),
                                                       bias=None if getattr(w, p).bias is None else
                                                       place(getattr(w, p).bias))
                                    for p in ("gate", "up", "down")})
        assert at <= (slot + 1) * slot_bytes
    return out


def test_stack_parts_views_a_slab_and_copies_the_rest():
    experts = _experts(E, D, I, seed=1)
    slab = on_slab({e: experts[e] for e in (1, 4, 5)})
    packed, rows = gm.stack_parts([slab[e].gate.packed for e in (5, 1, 4)])
    assert rows == [2, 0, 1] and packed.data_ptr() == slab[1].gate.packed.data_ptr()  # a view: no copy
    assert all(torch.equal(packed[r], slab[e].gate.packed) for r, e in zip(rows, (5, 1, 4)))
    scales, same = gm.stack_parts([slab[e].gate.scales for e in (5, 1, 4)], rows)
    assert same == rows and all(torch.equal(scales[r], slab[e].gate.scales) for r, e in zip(rows, (5, 1, 4)))
    copied, rows = gm.stack_parts([experts[e].gate.packed for e in (5, 1)], [1, 0])
    assert rows == [1, 0] and torch.equal(copied[1], experts[5].gate.packed) and torch.equal(copied[0], experts[1].gate.packed)


@pytest.mark.parametrize("layout", ["slab", "separate"])
@pytest.mark.parametrize("precision", ["exact", "q8"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_grouped_moe_matches_the_reference(device, precision, layout):
    experts = _experts(E, D, I, seed=2)
    held = {e: experts[e] for e in (0, 2, 3, 5)}  # a table lacking experts 1 and 4 (a tier holding some)
    if layout == "slab":
        held = on_slab(held)
    if device != "cpu":
        held = {e: SimpleNamespace(**{p: SimpleNamespace(**{k: None if t is None else t.to(device)
                                                             for k, t in vars(getattr(w, p)).items()})
                                      for p in ("gate", "up", "down")}) for e, w in held.items()}
    ids, weights = _routing(7, E, 3, seed=3)
    x = torch.randn(7, D, generator=torch.Generator().manual_seed(4))
    grouped = gm.GroupedExperts(held, E)
    for only in (None, 3):
        want = torch.zeros(7, D)  # the reference over the table's experts only
        for e in sorted(held) if only is None else [only]:
            naive_mxfp4_moe(x, ids, weights, experts, "gpt_oss", (7.0, 1.702), want, only=e, precision=precision)
        got = gm.grouped_moe(x.to(device), ids.to(device), weights.to(device), grouped, "gpt_oss", (7.0, 1.702),
                             torch.zeros(7, D, device=device), only=only, precision=precision)
        assert_close(got.cpu(), want, 1e-5, f"grouped ({layout}, only={only})")


def test_grouped_moe_never_syncs(monkeypatch):
    """Between building the stacks and the result, nothing reads the device on the host nor copies to it."""
    from localmoe.kernels.mxfp4_moe import triton as tk

    grouped = gm.GroupedExperts(on_slab(_experts(E, D, I, seed=5)), E)
    calls = []
    monkeypatch.setattr(tk, "mxfp4_grouped", lambda x, p, s, ids, b=None: calls.append(p) or x.new_zeros(
        x.shape[0], p.shape[1]))
    ids, weights = _routing(5, E, 2, seed=6)
    with _NoSync():
        gm.grouped_moe(torch.randn(5, D), ids, weights, grouped, "swiglu", (0.0, 0.0), torch.zeros(5, D))
    assert len(calls) == 3


def test_the_dispatcher_takes_the_grouped_path_for_a_gpu_table(monkeypatch):
    """mxfp4_moe with x on the table's device and Triton usable (faked here for CPU tensors) builds the
    table's stacks once and runs grouped_moe."""
    import localmoe.kernels.mxfp4_moe as dispatchers

    seen = []
    monkeypatch.setattr(dispatchers, "usable", lambda t: True)
    monkeypatch.setattr(dispatchers.cpu, "library", lambda: None)
    monkeypatch.setattr(gm, "grouped_moe", lambda x, ids, w, grouped, *a, **k: seen.append(grouped) or a[2])
    table = ExpertTable(_experts(E, D, I, seed=7), E)
    ids, weights = _routing(2, E, 2, seed=8)
    for _ in range(2):
        dispatchers.mxfp4_moe(torch.randn(2, D), ids, weights, table, "swiglu", (0.0, 0.0), torch.zeros(2, D))
    assert len(seen) == 2 and seen[0] is seen[1] is table.grouped
