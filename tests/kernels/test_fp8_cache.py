"""FP8 (e4m3, per-block scale) cache quantise/dequantise: Triton against the reference, the
reference against the engine's cache codec and against its own documented error bound."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels.fp8_cache.reference import naive_dequantize_fp8, naive_quantize_fp8

from .conftest import TRITON_DEVICES


def _rows(N, D, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) * torch.logspace(-4, 3, N).unsqueeze(1)
    if N > 2:
        x[1] = 0.0  # an all-zero block: scale 1
    return x.to(dtype)


def test_reference_error_bound():
    """|x - dq(q(x))| <= 2^-4 |x| where x / scale is normal, <= 2^-10 scale below."""
    x = _rows(64, 96, seed=0)
    q, s = naive_quantize_fp8(x)
    err = (naive_dequantize_fp8(q, s) - x).abs()
    bound = torch.maximum(x.abs() * 2.0 ** -4, s.unsqueeze(-1) * 2.0 ** -10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert s[1] == 1.0 and (q[1].float() == 0).all()


def test_reference_matches_engine_cache_codec():
    from localmoe.engine.cache import dequantize_fp8, quantize_fp8

    x = _rows(10, 64, seed=1)
    q1, s1 = naive_quantize_fp8(x)
    q2, s2 = quantize_fp8(x)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s1, s2)
    assert torch.equal(naive_dequantize_fp8(q1, s1), dequantize_fp8(q2, s2))


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("N,D", [(1, 64), (63, 96), (500, 128), (7, 576)], ids=lambda *a: None)
def test_triton_matches_reference(N, D, dtype, device, close):
    from localmoe.kernels.fp8_cache import triton as tk

    x = _rows(N, D, seed=N * D, dtype=dtype)
    q_ref, s_ref = naive_quantize_fp8(x)
    q, s = tk.quantize_fp8(x.to(device))
    close(s, s_ref, 1e-7, "scale")
    # the same codes (a differently rounded scale may move a value by one e4m3 step: count them)
    same = (q.cpu().view(torch.uint8) == q_ref.view(torch.uint8)).float().mean().item()
    assert same > 0.999, f"only {same:.4f} of the codes agree"
    y = tk.dequantize_fp8(q, s, torch.float32)
    close(y, naive_dequantize_fp8(q.cpu(), s.cpu()), 1e-7, "dequantise")
    close(y, x.float(), 2.0 ** -4, "round trip")
