"""Residual add + RMSNorm: the CPU kernel against a float64 evaluation, including the in-place
update of the residual stream, row tails (D not a multiple of 8) and the fallback."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels._cpu import library
from localmoe.kernels.rms_norm import add_rms_norm, naive_add_rms_norm

needs_cpu_kernel = pytest.mark.skipif(library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")


def _float64(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float):
    s = x.double() + (0 if delta is None else delta.double())
    return s, s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps) * weight.double()


@needs_cpu_kernel
@pytest.mark.parametrize("shape", [(1, 1, 768), (2, 9, 100), (5, 7), (3, 64)], ids=str)
@pytest.mark.parametrize("with_delta", [True, False], ids=["add", "norm-only"])
def test_kernel_matches_float64(shape, with_delta, close):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 3
    delta = torch.randn(*shape, generator=g) if with_delta else None
    weight = 1 + 0.3 * torch.randn(shape[-1], generator=g)
    residual, normed = _float64(x, delta, weight, 1e-5)
    got = add_rms_norm(x, delta, weight, 1e-5)
    close(x, residual, 1e-7, "residual updated in place")
    close(got, normed, 1e-6, "normed")


def test_fallback_for_tensors_the_kernel_does_not_take(close):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 6, generator=g).t()  # not contiguous
    delta = torch.randn(6, 8, generator=g)
    weight = torch.randn(8, generator=g)
    want_x, want = _float64(x, delta, weight, 1e-6)
    got = add_rms_norm(x, delta, weight, 1e-6)
    close(x, want_x, 1e-7, "residual")
    close(got, want, 1e-6, "normed")
    close(naive_add_rms_norm(want_x.float().clone(), None, weight, 1e-6), want, 1e-6, "reference")
