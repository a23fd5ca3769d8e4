"""Weights on huge pages (kernels/_cpu/pages.py): the same values, in advised 2 MiB-aligned chunks that
live as long as a tensor in them; Linear, resident dense experts and the GGUF-block linears' joined parts keep their
weights there."""

from __future__ import annotations

import gc
import mmap
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from localmoe.kernels._cpu import pages

from localmoe.engine.experts import ResidentExperts
from localmoe.engine.linear import Linear
from localmoe.engine.quantized import BlockLinear, BlockQuantized
from localmoe.kernels.ggml_gemv import ggml_gemv, kernel_available
from localmoe.testing.ggml_blocks import random_blocks

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
needs_thp = pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE") or not THP.exists() or "[never]" in THP.read_text(),
                               reason="no transparent huge pages on this system")


def _anon_huge_bytes(tensor: torch.Tensor) -> int:
    """AnonHugePages of the mapping that holds the tensor's first byte (/proc/self/smaps)."""
    ptr, inside = tensor.data_ptr(), False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= ptr < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) << 10
    return 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.uint8])
def test_copy_has_the_values_aligned_and_is_kept_once(dtype):
    src = (torch.randn(300, 257) * 100).to(dtype)
    out = pages.huge_copy(src)
    assert out.dtype == dtype and out.shape == src.shape and out.is_contiguous()
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
    assert out.data_ptr() % pages.ALIGN == 0
    assert pages.on_huge_pages(out) and not pages.on_huge_pages(src)
    assert pages.huge_copy(out) is out  # already there: no second copy
    strided = pages.huge_copy(src.t())  # a transposed view: copied contiguous
    assert strided.is_contiguous() and torch.equal(strided, src.t())


def test_small_tensors_stay_where_they_are():
    small = torch.randn(16, 16)
    assert pages.huge_copy(small) is small


def test_a_large_tensor_gets_its_own_chunk_which_goes_with_it():
    big = pages.huge_copy(torch.ones(pages.CHUNK // 4 + 4096, dtype=torch.uint8))
    start = big.data_ptr()
    assert start % pages.HUGE == 0
    (alive,) = [alive for begin, _, alive in pages._chunks if begin == start]
    view = big[4096:]
    del big
    gc.collect()
    assert pages.on_huge_pages(view) and alive() is not None  # a view keeps the chunk
    del view
    gc.collect()
    assert alive() is None  # the map is released with its last tensor


@needs_thp
def test_the_chunk_is_backed_by_huge_pages():
    w = pages.huge_copy(torch.randn(4 << 20))  # 16 MiB
    assert _anon_huge_bytes(w) >= 8 << 20


def test_linear_and_dense_experts_keep_their_weights_on_huge_pages():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(512, 256, generator=g)
    lin = Linear(w, None, "float32")
    assert pages.on_huge_pages(lin.weight) and torch.equal(lin.weight, w)
    x = torch.randn(3, 256, generator=g)
    assert torch.allclose(lin(x), x @ w.T, rtol=1e-5, atol=1e-5)
    gate_up, down = torch.randn(4, 2 * 64, 256, generator=g), torch.randn(4, 256, 64, generator=g)
    experts = ResidentExperts.from_weights({"model.layers.1.mlp.experts.gate_up_proj.weight": gate_up,
                                            "model.layers.1.mlp.experts.down_proj.weight": down},
                                           "model.layers.1.", 1, 4)
    e = experts.get(1, 2)
    assert all(pages.on_huge_pages(p.weight) for p in (e.gate, e.up, e.down))
    assert torch.equal(e.gate.weight, gate_up[2, :64]) and torch.equal(e.down.weight, down[2])


@pytest.mark.skipif(not kernel_available(), reason="no CPU kernel library")
@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this system")
def test_block_linear_keeps_its_joined_parts_on_huge_pages():
    """q; k; v (and gate; up) of one GGUF type join into one segment, a new tensor a decode token streams: it lies on
    huge pages as the loader's repacked parts do (the embedded model's 3-row step read its Q4_1 matrices ~1.3x slower
    with these on 4 KiB pages); a part that joins nothing stays the tensor it was; the rows compute what the parts
    give."""
    q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(5)
    shapes = ((q.Q4_1, 256), (q.Q4_1, 64), (q.Q8_0, 64))  # q, k in Q4_1 (joined: 200 KB), v in Q8_0
    raws = [torch.from_numpy(random_blocks(t, rows, 1024, rng)) for t, rows in shapes]
    lin = BlockLinear([BlockQuantized(r, t, (rows, 1024)) for r, (t, rows) in zip(raws, shapes)], None)
    (joined, kind, n), (alone, other, m) = lin.segments
    assert (kind, n, other, m) == (q.Q4_1, 320, q.Q8_0, 64)
    assert pages.on_huge_pages(joined) and not any(pages.on_huge_pages(r) for r in raws)
    assert torch.equal(joined, torch.cat(raws[:2]))
    assert alone.data_ptr() == raws[2].data_ptr()  # joins nothing: not copied
    x = torch.randn(3, 1024, generator=torch.Generator().manual_seed(0))
    expect = torch.cat([ggml_gemv(x, r, t, (rows, 1024)) for r, (t, rows) in zip(raws, shapes)], dim=1)
    assert torch.equal(lin(x), expect)
