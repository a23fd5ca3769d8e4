"""The CPU kernels' in-place cache rows (kernels/fp8_cache/cache_rows.h, which the fused hybrid decode step
inlines) against engine/cache.py's PagedBuffer: the same stored bits (bf16, fp8 values and scales, the exact
ring) for the same written rows, the same fp32 rows read back, in the AVX2 and AVX-512 builds."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu
from localmoe.kernels.fp8_cache import cpu

from localmoe.engine import cache as engine_cache

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")


def _hard_rows(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows whose values sit on and around e4m3 / bf16 rounding midpoints, subnormals, zeros and big ranges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g) * torch.logspace(-30, 30, n).unsqueeze(1)
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)]
    mids = (grid.sort().values[1:] + grid.sort().values[:-1]) / 2  # exact ties between e4m3 neighbours
    for i in range(2, n, 3):  # rows scaled so that x / scale lands on the midpoints (amax 448 -> scale 1)
        pick = mids[torch.randint(len(mids), (dim,), generator=g)]
        pick[0] = 448.0
        x[i] = pick * (2.0 ** (i % 7 - 3))
    x[1] = 0.0
    x[4, ::2] = torch.nextafter(x[4, ::2], torch.tensor(float("inf")))
    return x


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
@pytest.mark.parametrize("isa", _cpu.supported_isas())
def test_kernel_write_and_read_are_the_engines(dtype, isa, monkeypatch):
    monkeypatch.setattr(engine_cache, "BLOCK_TOKENS", 16)
    heads, dim, n = 3, 40, 70  # 70 positions: past the 32-row exact ring and over 5 blocks
    rows = _hard_rows(n * heads, dim, seed=7).view(n, heads, dim)
    want = engine_cache.PagedBuffer(1, 96, heads, dim, dtype)
    got = engine_cache.PagedBuffer(1, 96, heads, dim, dtype)
    with _cpu.forced_isa(isa):
        for pos in range(n):
            want.write(pos, rows[pos][None, :, None])
            view = cpu.cache_rows(*got.storage(pos + 1))
            cpu.write(view, pos, rows[pos].reshape(-1))
        stored = [b.storage(n) for b in (got, want)]  # pools [H, capacity, D] (identity tables), scales
        assert torch.equal(stored[0][0][:, :n].view(torch.uint8), stored[1][0][:, :n].view(torch.uint8))
        if dtype == "fp8":
            assert torch.equal(stored[0][1][:, :n], stored[1][1][:, :n])
        assert torch.equal(got.recent, want.recent) and torch.equal(got.recent_pos, want.recent_pos)
        read = want.read(n)[0]  # [H, n, D]
        view = cpu.cache_rows(*got.storage(n))
        for h in range(heads):
            for s in range(n):
                assert torch.equal(cpu.read(view, h, s, n), read[h, s]), (h, s)
    assert not torch.equal(read[:, :n - 32], rows[:n - 32].transpose(0, 1))  # the older rows are rounded


def test_the_rows_hold_rounding_ties():
    """The rows above put many values exactly between two e4m3 neighbours: rounding them up instead of to
    even changes the stored bits, so the comparison sees the tie rule."""
    x = _hard_rows(9, 40, seed=7)
    q, s = engine_cache.quantize_fp8(x)
    y = x / s[:, None]
    lo = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    ties = torch.isin(y.abs(), (lo[1:127] + lo[:126]) / 2)  # exactly between two e4m3 neighbours
    assert ties.sum() > 20
    up = torch.where(ties, (y.abs() * (1 + 2 ** -20)).copysign(y), y).to(torch.float8_e4m3fn)
    assert not torch.equal(up.view(torch.uint8), q.view(torch.uint8))
