"""GEMV from GGUF Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K / Q6_K / IQ4_NL / IQ4_XS blocks for 1..N tokens: the
CPU kernel against its reference (exact dequantisation, x rounded to int8 per 32 values, per 256 for the
K-quants) evaluated in float64, and the properties the engine relies on (a row's result independent of the thread count and
of the other tokens in the call, fallbacks)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from localmoe.kernels.ggml_gemv import (EXACT_X_TYPES, K_QUANTS, TYPES, X16_TYPES, ggml_gemv, kernel_available,
                                        naive_ggml_gemv, q16_round, row_values)

from localmoe.testing.ggml_blocks import random_blocks

needs_cpu_kernel = pytest.mark.skipif(not kernel_available(), reason="CPU kernel unavailable (no AVX2 or compiler)")
Q = gguf.GGMLQuantizationType
IQ4 = (Q.IQ4_NL, Q.IQ4_XS)


def _weight(ggml_type, O: int, K: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    if ggml_type in K_QUANTS or ggml_type in IQ4:  # gguf cannot quantise to these: random codes and scales, sane steps
        return torch.from_numpy(random_blocks(ggml_type, O, K, rng))
    w = rng.standard_normal((O, K)).astype(np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(w, ggml_type).copy())


def _k_for(ggml_type, K: int) -> int:
    """K rounded up to the type's block: K-quants and IQ4_XS take whole super-blocks of 256."""
    unit = row_values(ggml_type)
    return -(-K // unit) * unit


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N,K", [(1, 576), (3, 96), (8, 1536), (17, 608), (33, 160)],
                         ids=["N1", "N3", "N8", "N17", "N33"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_cpu_kernel_matches_float64(ggml_type, N, K, bias, close):
    """Odd N past both tile sizes (4 tokens on AVX2, 8 with AVX-512), odd block counts (K / 32 = 19, 5)
    and an odd O. Tolerance 2e-6 relative RMS: fp32 accumulation against the float64 reference on the
    same int8-rounded x (the rounding itself is in the reference)."""
    O, K = 73, _k_for(ggml_type, K)
    raw = _weight(ggml_type, O, K, seed=N + K)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    x[:, 3] *= 25  # one large channel: its blocks round everything else coarsely
    b = torch.randn(O) if bias else None
    got = ggml_gemv(x, raw, ggml_type, (O, K), b)
    close(got, naive_ggml_gemv(x.double(), raw, ggml_type, (O, K), b), 2e-6, ggml_type.name)


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", EXACT_X_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("N", [1, 5, 19])
def test_fp32_x_matches_float64(ggml_type, N, close):
    """exact_x: Q8_0 / Q4_K / Q6_K blocks against x as it is (no rounding), for the lm_head."""
    K = _k_for(ggml_type, 576)
    raw = _weight(ggml_type, 40, K, seed=10)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(11))
    x[:, 3] *= 25
    got = ggml_gemv(x, raw, ggml_type, (40, K), exact_x=True)
    close(got, naive_ggml_gemv(x.double(), raw, ggml_type, (40, K), exact_x=True), 2e-6, f"{ggml_type.name} fp32 x")
    assert not torch.allclose(got, ggml_gemv(x, raw, ggml_type, (40, K)), rtol=1e-4)  # not the int8 path
    with pytest.raises(ValueError, match="Q8_0"):
        ggml_gemv(x[:, :576], _weight(Q.Q4_0, 8, 576, seed=12), Q.Q4_0, (8, 576), exact_x=True)


def _modes(ggml_type) -> list[dict]:
    """What x each type's rows read: int8 always, fp32 (exact_x) and int16 (x16) where the type has them."""
    return [{}] + [{"exact_x": True}] * (ggml_type in EXACT_X_TYPES) + [{"x16": True}] * (ggml_type in X16_TYPES)


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", [t for t in X16_TYPES if t in TYPES], ids=lambda t: t.name)  # (Q8_0_R16:
@pytest.mark.parametrize("N", [1, 5, 19])  # test_ggml_repack.py holds it to the GGUF layout's bits)
def test_int16_x_matches_float64(ggml_type, N, close):
    """x16: Q8_0 blocks against x rounded to int16 per 32 values (the dense lm_head's default); 43 rows: groups of
    sixteen (AVX-512), eight and rows alone. Against fp32 x it is ~2^-16 of a block's largest value off, where the
    int8 rounding is ~2^-8."""
    O, K = 43, 576
    raw = _weight(ggml_type, O, K, seed=14)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(15))
    x[:, 3] *= 25
    got = ggml_gemv(x, raw, ggml_type, (O, K), x16=True)
    close(got, naive_ggml_gemv(x.double(), raw, ggml_type, (O, K), x16=True), 2e-6, f"{ggml_type.name} int16 x")
    exact = naive_ggml_gemv(x.double(), raw, ggml_type, (O, K), exact_x=True)
    int8 = naive_ggml_gemv(x.double(), raw, ggml_type, (O, K))
    err16, err8 = (got.double() - exact).abs().max().item(), (int8 - exact).abs().max().item()
    assert err16 < err8 / 50, f"int16 x {err16:.3e} against int8 x {err8:.3e} off the fp32-x product"
    assert torch.equal(q16_round(torch.zeros(2, 64)), torch.zeros(2, 64))
    with pytest.raises(ValueError, match="x16"):
        ggml_gemv(x, _weight(Q.Q4_1, 8, K, seed=12), Q.Q4_1, (8, K), x16=True)
    with pytest.raises(ValueError, match="x16"):
        ggml_gemv(x, raw, ggml_type, (O, K), exact_x=True, x16=True)


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_row_has_the_same_bits_alone_and_in_a_batch(ggml_type):
    """A token's outputs do not depend on how many tokens share the call, nor on which: the batched
    decode step (engine/batch.py) relies on it for greedy output equal to a sequence decoded alone."""
    O, K = 45, _k_for(ggml_type, 352)
    raw = _weight(ggml_type, O, K, seed=20)
    x = torch.randn(21, K, generator=torch.Generator().manual_seed(21))
    x[5, 7] = 300.0  # one token with a coarse block: must not touch the others
    for mode in _modes(ggml_type):
        batch = ggml_gemv(x, raw, ggml_type, (O, K), **mode)
        for n in (1, 2, 5, 9):
            part = ggml_gemv(x[3:3 + n].contiguous(), raw, ggml_type, (O, K), **mode)
            assert torch.equal(part, batch[3:3 + n]), f"{ggml_type.name} {mode}: {n} rows"
        for i in (0, 20):
            assert torch.equal(ggml_gemv(x[i:i + 1], raw, ggml_type, (O, K), **mode), batch[i:i + 1])


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", TYPES, ids=lambda t: t.name)
def test_a_weight_row_has_the_same_bits_in_a_group_and_alone(ggml_type):
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K / Q5_K rows (Q8_0 on fp32 / int16 x too) run eight at a time (rows_fixed:
    one lane per weight row) and a range's leftover rows alone (G::single): the two must give a (row, token) the same
    bits, wherever the call's row range starts (the MoE kernels compute slices of rows; threads split the rows)."""
    O, K = 21, _k_for(ggml_type, 352)
    raw = _weight(ggml_type, O, K, seed=22)
    x = torch.randn(18, K, generator=torch.Generator().manual_seed(23))
    x[4, 9] = 300.0
    for mode in _modes(ggml_type):  # Q8_0 on fp32 / int16 x: rows8 too
        whole = ggml_gemv(x, raw, ggml_type, (O, K), **mode)
        for first, last in ((0, 1), (3, 21), (5, 18), (13, 21)):
            part = ggml_gemv(x, raw[first:last].contiguous(), ggml_type, (last - first, K), **mode)
            assert torch.equal(part, whole[:, first:last]), f"{ggml_type.name} {mode}: rows {first}..{last}"


@needs_cpu_kernel
def test_independent_of_threads_and_of_the_other_tokens():
    raw = _weight(Q.Q4_1, 200, 576, seed=1)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ggml_gemv(x, raw, Q.Q4_1, (200, 576))
        torch.set_num_threads(max(2, threads))
        more = ggml_gemv(x, raw, Q.Q4_1, (200, 576))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, more)
    assert torch.equal(ggml_gemv(x[2:3], raw, Q.Q4_1, (200, 576)), one[2:3])


def test_other_types_and_inputs_use_the_reference(close):
    raw = (torch.randn(8, 256, generator=torch.Generator().manual_seed(3)) * 0.05).half().view(torch.uint8)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(4))  # F16: not a kernel type
    close(ggml_gemv(x, raw, Q.F16, (8, 256)), naive_ggml_gemv(x.double(), raw, Q.F16, (8, 256)), 1e-6, "f16")
    raw = _weight(Q.Q8_0, 8, 64, seed=5)
    x64 = torch.randn(2, 64, dtype=torch.float64)
    assert ggml_gemv(x64, raw, Q.Q8_0, (8, 64)).dtype == torch.float64  # not fp32: the reference


def test_reference_is_the_dequantised_weight_on_rounded_inputs():
    """naive_ggml_gemv = q8_round(x, block) @ W^T with W from gguf's own dequantiser (independent of ours):
    x rounded per 32 values (Q8_0), per 256 for the K-quants' rows (Q8_K, as llama.cpp), which differs."""
    from localmoe.kernels.mxfp4_moe import q8_round

    for ggml_type in TYPES:
        K = _k_for(ggml_type, 512)
        raw = _weight(ggml_type, 16, K, seed=6)
        w = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), ggml_type).astype(np.float64))
        x = torch.randn(3, K, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
        x[:, 3] *= 25
        block = 256 if ggml_type in (Q.Q4_K, Q.Q5_K, Q.Q6_K) else 32
        torch.testing.assert_close(naive_ggml_gemv(x, raw, ggml_type, (16, K)), q8_round(x, block) @ w.T)
        other = q8_round(x, 288 - block) @ w.T
        assert not torch.allclose(naive_ggml_gemv(x, raw, ggml_type, (16, K)), other, rtol=1e-4), ggml_type.name


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", IQ4, ids=lambda t: t.name)
def test_iq4_rows_run_in_the_kernel(ggml_type, close):
    """IQ4_NL / IQ4_XS rows are the library's (ggml_rows_iq4.h), not the reference's dequantise-and-multiply: the
    library takes the type (one token and 16 rows: the one-token path and AVX-512's sixteen-row groups), its values
    are the reference's, and a row of IQ4_XS that is not whole super-blocks is refused."""
    from localmoe.kernels._cpu import library

    lib = library()
    K = 768
    raw = _weight(ggml_type, 40, K, seed=30)
    for N in (1, 16):
        x = torch.randn(N, K, generator=torch.Generator().manual_seed(31 + N))
        y = torch.empty(N, 40)
        scratch = torch.empty(lib.ggml_gemv_scratch(N, K), dtype=torch.uint8)
        assert lib.ggml_gemv(x.data_ptr(), N, K, raw.data_ptr(), int(ggml_type), 40, None, y.data_ptr(),
                             scratch.data_ptr(), 1, 0) == 0, ggml_type.name
        close(y, naive_ggml_gemv(x.double(), raw, ggml_type, (40, K)), 2e-6, f"{ggml_type.name} N={N}")
        assert torch.equal(y, ggml_gemv(x, raw, ggml_type, (40, K)))
    if ggml_type == Q.IQ4_XS:
        assert lib.ggml_gemv(x.data_ptr(), 1, 288, raw.data_ptr(), int(ggml_type), 1, None, y.data_ptr(),
                             scratch.data_ptr(), 1, 0) == -1


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", (*K_QUANTS, Q.IQ4_XS), ids=lambda t: t.name)
def test_k_quants_need_whole_super_blocks(ggml_type, close):
    """A K that is not a multiple of 256 is not a K-quant row: the kernel does not read it; the
    reference names the fault."""
    from localmoe.errors import CheckpointError

    raw = _weight(ggml_type, 4, 256, seed=13)
    with pytest.raises(CheckpointError, match="256-value block"):
        ggml_gemv(torch.randn(1, 288), raw, ggml_type, (4, 288))


@needs_cpu_kernel
@pytest.mark.parametrize("ggml_type", [Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K], ids=lambda t: t.name)
def test_rows_dequantised_in_c_equal_the_whole_table(ggml_type):
    """dequantize_rows (a BlockEmbedding's lookup) gives the bits of quant/ggml.py's dequantiser of the whole
    table, rows in the order asked, repeats included; types it lacks come back None (the torch path)."""
    import ctypes

    from localmoe.kernels.ggml_gemv import dequantize_row, dequantize_rows, row_reader

    from localmoe.engine.quantized import BlockEmbedding, BlockQuantized
    from localmoe.quant.ggml import dequantize

    rows, K = 37, 512
    raw = torch.from_numpy(random_blocks(ggml_type, rows, K, np.random.default_rng(8)))
    whole = dequantize(raw, ggml_type, (rows, K), torch.float32)
    ids = torch.tensor([5, 0, 36, 5, 17])
    got = dequantize_rows(raw, ids, ggml_type, K)
    assert torch.equal(got.view(torch.int32), whole[ids].view(torch.int32))
    assert dequantize_rows(_weight(Q.Q4_0, 4, 64, seed=9), ids[:1] % 4, Q.Q4_0, 64) is None
    for i in (0, 17, 36):  # one token's row (a decode step's lookup, BlockEmbedding[token])
        assert torch.equal(dequantize_row(raw, i, ggml_type, K).view(torch.int32), whole[i].view(torch.int32))
        assert torch.equal(BlockEmbedding(BlockQuantized(raw, ggml_type, (rows, K)))[torch.tensor(i)], whole[i])
    assert dequantize_row(raw, rows, ggml_type, K) is None and dequantize_row(raw, -1, ggml_type, K) is None
    read = row_reader(raw, ggml_type, K)  # a decode step's lookup: the row in a kept buffer, by address
    for i in (36, 0, 17):
        row = torch.frombuffer(bytearray((ctypes.c_float * K).from_address(read(i))), dtype=torch.float32)
        assert torch.equal(row.view(torch.int32), whole[i].view(torch.int32))
    assert row_reader(_weight(Q.Q4_0, 4, 64, seed=9), Q.Q4_0, 64) is None
