"""The GPU tier's compute path through the Triton MXFP4 kernel: a paged MoE layer with experts in a
GPU tier, against the resident layer.

On a machine without CUDA the tier's slab is on "cpu", the MXFP4 dispatchers are told the Triton
kernel is usable for CPU tensors and the C library is hidden from them, so Triton runs under
TRITON_INTERPRET=1 (set by conftest): the layer's GPU-tier experts then take exactly the calls
they take on a GPU (`mxfp4_moe`'s per-expert path, `mxfp4_linear` -> Triton; on CUDA also the tier's tokens
copied once and its own sum, which a "cpu" slab, on x's device, does not need); the CPU tier's experts go through Triton too (no C library), which
only makes the comparison stricter. With CUDA the slab is on cuda:0 and nothing is patched.
"""

from __future__ import annotations

import pytest
import torch

from localmoe.config import PagingConfig
from localmoe.convert import convert
from localmoe.load import load_model
from localmoe.paging import expert_bytes
from localmoe.paging.gpu import GpuSlab
from localmoe.paging.placement import Bandwidths
from localmoe.store.packed import PackedStore
from localmoe.testing import write_checkpoint

from .conftest import TRITON_DEVICES, assert_close

COPY_ALWAYS = Bandwidths(disk=1e9, cpu_expert=1e9, pcie=50e9, gpu_expert=1e12, gpu_overhead=0.0)


@pytest.mark.parametrize("precision", ["exact", "q8"])
@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_gpu_tier_layer_through_triton(tmp_path, monkeypatch, device, precision):
    src = write_checkpoint("gpt_oss", tmp_path / "src", size="tiny", seed=3)
    convert(src, tmp_path / "store", experts="mxfp4")
    # half the experts' bytes in RAM: a slab that holds every expert would take them whole at attach (no hooks
    # to place by; localmoe.paging attaches with GPU slabs that way)
    budget = expert_bytes(PackedStore(tmp_path / "store")) // 2
    model = load_model(tmp_path / "store", dtype="float32", expert_precision=precision, progress=False,
                       paging=PagingConfig(ram_budget=budget)).model
    resident = load_model(src, dtype="float32", expert_precision=precision, progress=False).model
    pager = model.moe_blocks()[0].experts
    slot = pager.slab.slot_bytes
    import localmoe.kernels.mxfp4_moe as dispatchers
    from localmoe.kernels.mxfp4_moe import triton as tk

    slab = GpuSlab(device if device == "cpu" else "cuda:0", 64 * slot, slot)
    base, end = slab.memory.data_ptr(), slab.memory.data_ptr() + slab.memory.nbytes
    on_slab = []  # per Triton call: are its weights views of the GPU tier's slots?
    grouped = tk.mxfp4_grouped
    monkeypatch.setattr(tk, "mxfp4_grouped",
                        lambda *a, **k: on_slab.append(base <= a[1].data_ptr() < end) or grouped(*a, **k))
    if device == "cpu":
        monkeypatch.setattr(dispatchers, "usable", lambda t: True)
        monkeypatch.setattr(dispatchers.cpu, "library", lambda: None)
    pager.use_gpus([slab], COPY_ALWAYS)
    block, reference = model.moe_blocks()[1], resident.moe_blocks()[1]
    x = torch.randn(1, 7, block.router.linear.weight.shape[1], generator=torch.Generator().manual_seed(0))
    _, ids = reference.router(x.reshape(-1, x.shape[-1]))
    on_gpu = ids.unique().tolist()[1::2]  # half the chosen experts in the GPU tier, half on the CPU
    for e in on_gpu:
        pager.placed(block.layer, e, tokens=1)
    pager.bandwidths = Bandwidths(disk=1e9, cpu_expert=1e12, pcie=1e6, gpu_expert=1e12)  # the rest stays
    pager.stats.computed.clear()  # the placements above are set-up: count the forward's experts only
    on_slab.clear()
    try:
        got = block(x)
    finally:
        pager.close()
    assert pager.stats.computed == {"ram": ids.unique().numel() - len(on_gpu), "gpu0": len(on_gpu)}
    # gate, up and down of each GPU-tier expert in Triton, on the tier's slots; on the interpreter the
    # CPU tier's experts run Triton too (no C library), from RAM slots
    assert on_slab.count(True) == 3 * len(on_gpu)
    assert on_slab.count(False) == (3 * pager.stats.computed["ram"] if device == "cpu" else 0)
    want = reference(x)
    assert_close(got, want, 1e-5, f"GPU-tier layer ({precision})")
