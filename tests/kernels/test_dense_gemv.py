"""Dense fp32/bf16 GEMV: the CPU kernel and the dispatcher against the plain-torch reference."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu, dense_gemv
from localmoe.kernels.dense_gemv import cpu
from localmoe.kernels.dense_gemv.reference import naive_dense_gemv

needs_cpu_kernel = pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _inputs(N: int, K: int, O: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, K, generator=g)
    scale = torch.logspace(-3, 1, O).unsqueeze(1)  # rows of very different scales
    w = (torch.randn(O, K, generator=g) * scale).to(dtype)
    return x, w, torch.randn(O, generator=g)


def _want(x, w, bias):
    """The reference in float64 (the kernel's error against fp32 torch is summation order only)."""
    return naive_dense_gemv(x.double(), w.double(), None if bias is None else bias.double())


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("O", [1, 100, 4097], ids=lambda o: f"O{o}")
@pytest.mark.parametrize("K", [63, 576, 768], ids=lambda k: f"K{k}")
@pytest.mark.parametrize("N", [1, 3, 8, 11], ids=lambda n: f"N{n}")
def test_cpu_matches_reference(N, K, O, with_bias, dtype, close):
    x, w, bias = _inputs(N, K, O, dtype, seed=N * 10007 + K * 13 + O)
    bias = bias if with_bias else None
    got = cpu.gemv(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (N, O)
    close(got, _want(x, w, bias), 1e-6)
    close(got, naive_dense_gemv(x, w, bias), 1e-6)  # and the fp32 reference itself


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_thread_count_does_not_change_bits(dtype):
    x, w, bias = _inputs(3, 576, 3000, dtype, seed=1)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.gemv(x, w, bias)
        torch.set_num_threads(2)
        two = cpu.gemv(x, w, bias)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_and_inf_propagate(dtype):
    x, w, _ = _inputs(2, 100, 5, dtype, seed=2)
    x[1, 7] = float("nan")
    w[3, 99] = float("inf")  # in the scalar tail (K = 100 = 12 * 8 + 4)
    w[4, 0] = float("nan")
    got, want = cpu.gemv(x, w), naive_dense_gemv(x, w)
    assert torch.equal(got.isnan(), want.isnan()) and got[1].isnan().all() and got[0, 4].isnan()
    assert torch.equal(got.isinf(), want.isinf())


@pytest.mark.parametrize("dtype", DTYPES)
def test_dispatcher_falls_back_without_the_library(dtype, monkeypatch, close):
    x, w, bias = _inputs(2, 64, 20, dtype, seed=3)
    monkeypatch.setitem(_cpu._state, "lib", None)
    assert not dense_gemv.kernel_available()
    close(dense_gemv.dense_gemv(x, w, bias), _want(x, w, bias), 1e-6)


@pytest.mark.parametrize("case", ["strided_x", "fp16_weight", "bf16_x"])
def test_dispatcher_falls_back_for_other_inputs(case, close):
    x, w, bias = _inputs(4, 64, 20, torch.float32, seed=4)
    if case == "strided_x":
        x = torch.randn(64, 4).T  # not contiguous
    elif case == "fp16_weight":
        w = w.half()
    else:
        x = x.bfloat16()
    close(dense_gemv.dense_gemv(x, w, bias), _want(x.float(), w, bias), 1e-6)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_prepared_kernel_gives_the_checked_calls_bits(dtype):
    """kernel_for checks a weight once; its calls equal dense_gemv's, and it refuses what the kernel
    cannot read (then the caller keeps the checked dispatcher)."""
    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(40, 64, generator=g).to(dtype), torch.randn(40, generator=g)
    x = torch.randn(3, 64, generator=g)
    assert torch.equal(dense_gemv.kernel_for(w, b)(x), dense_gemv.dense_gemv(x, w, b))
    assert dense_gemv.kernel_for(w.half(), b) is None  # fp16 weights
    assert dense_gemv.kernel_for(w.t(), None) is None  # not contiguous
    assert dense_gemv.kernel_for(w, b[:10]) is None  # bias of the wrong length
    assert dense_gemv.kernel_for(w, b.double()) is None  # bias not fp32


@needs_cpu_kernel
def test_read_sums_are_the_chunk_sums():
    x = torch.randn(cpu.READ_CHUNK * 7, generator=torch.Generator().manual_seed(3))
    want = x.double().view(7, -1).sum(1)
    assert torch.allclose(cpu.read_sums(x).double(), want, rtol=0, atol=1e-3)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_prompt_rows_keep_their_alone_bits_across_token_blocks(dtype, close):
    """A prompt chunk's rows (the engine's Linear sends every call to the kernel): at K = 2051 a token block is
    28 rows (AVX-512; AVX2: 30; dense_tiles.h kTileTokenBytes), so 70 rows span three blocks and a short last one;
    each row has the bits it has alone, and the whole is the reference's."""
    x, w, bias = _inputs(70, 2051, 37, dtype, seed=70)
    alone = torch.cat([cpu.gemv(x[n:n + 1], w, bias) for n in range(70)])
    got = cpu.gemv(x, w, bias)
    assert torch.equal(got, alone)
    close(got, _want(x, w, bias), 1e-6)


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_split_into_tiles_keeps_alone_bits(dtype):
    """3-14 rows: every way `tile_outputs` splits tokens into groups of at most kTileRows (as even as they go: 9 rows
    are 3 + 3 + 3 on AVX-512, 13 are 4 + 3 + 3 + 3), against 37 outputs (whole tiles of 5 (AVX-512) or 3 (AVX2) and
    one-row tiles at the end): each row has the bits it has alone."""
    x, w, bias = _inputs(14, 768, 37, dtype, seed=14)
    alone = torch.cat([cpu.gemv(x[n:n + 1], w, bias) for n in range(14)])
    for n in range(3, 15):
        assert torch.equal(cpu.gemv(x[:n].contiguous(), w, bias), alone[:n]), f"{n} rows"
