"""A paged store's dense experts are stored as a resident model stores them (linear.stored_dtype's rule: bf16 for
engine dtype "bfloat16", and for "float32" where every value is exactly bf16), so paged equals resident bit for
bit, and a `--ram 100%` slab streams the bytes a resident decode streams."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from localmoe.config import EngineConfig, PagingConfig
from localmoe.convert import convert
from localmoe.load import load_model
from localmoe.paging import expert_bytes
from localmoe.paging.metrics import pager_of
from localmoe.store.packed import PackedStore
from localmoe.testing import write_checkpoint

from .conftest import run_greedy


def _fp32_experts(src, exact: bool) -> None:
    """Rewrite `src`'s routed experts as fp32: their bf16 values widened (`exact`) or moved off bf16's grid."""
    for shard in sorted(src.glob("*.safetensors")):
        tensors = load_file(shard)
        for name, t in tensors.items():
            if ".experts." in name and t.is_floating_point() and t.dim() == 2:
                t = t.float()
                tensors[name] = t if exact else t * (1 + 2.0 ** -12)  # no longer exactly bf16
        save_file(tensors, shard, metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["exact", "off-grid"])
def fp32_experts(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"dense-{request.param}")
    src = write_checkpoint("kimi_linear", root / "hf", "tiny", seed=1)
    _fp32_experts(src, request.param == "exact")
    convert(src, root / "store", experts="keep")  # the experts stay fp32 in the store
    return request.param, src, root / "store"


def _matrices(pager) -> set[torch.dtype]:
    return {p.weight.dtype for experts in pager._resident.experts.values() for w in experts
            for p in (w.gate, w.up, w.down)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("share", [1.0, 0.25])
def test_paged_dense_experts_follow_the_resident_rule(fp32_experts, dtype, share):
    kind, src, store = fp32_experts
    layouts = PackedStore(store)
    assert {p.dtype for layer in layouts.layers() for p in layouts.layout(layer).parts} == {torch.float32}
    resident = load_model(src, EngineConfig(dtype=dtype, threads=1), progress=False).model
    want_tokens, want = run_greedy(resident)
    budget = int(expert_bytes(PackedStore(store)) * share)
    paged = load_model(store, EngineConfig(dtype=dtype, threads=1, paging=PagingConfig(ram_budget=budget)),
                       progress=False).model
    pager = pager_of(paged)
    try:
        tokens, got = run_greedy(paged)
        if share == 1.0:  # every expert pinned in the slab, stored as the resident model stores them
            assert pager._resident is not None
            rounded = dtype == "bfloat16" or kind == "exact"
            assert _matrices(pager) == {torch.bfloat16 if rounded else torch.float32}
        else:
            assert pager._resident is None and pager.stats.ram.misses > 0
    finally:
        pager.close()
    assert tokens == want_tokens
    for step, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"logits differ at step {step}: max {(a - b).abs().max().item():.3e}"
