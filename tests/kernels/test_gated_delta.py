"""Gated DeltaNet Triton kernels (recurrent, chunked) against the per-head-decay reference, and
that reference against KDA's with the decay repeated over K (two independent loops)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels.gated_delta.reference import naive_recurrent_gated_delta
from localmoe.kernels.kda.reference import naive_recurrent_kda

from .conftest import TRITON_DEVICES


def _inputs(B, T, H, K, V, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen)
    g = -torch.rand(B, T, H, generator=gen) * 2.0
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, V, generator=gen) * 0.1
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [state]


def test_reference_is_kda_with_repeated_decay():
    q, k, v, g, beta, s = _inputs(2, 5, 2, 8, 4, seed=0)
    o1, s1 = naive_recurrent_gated_delta(q, k, v, g, beta, s)
    o2, s2 = naive_recurrent_kda(q, k, v, g.unsqueeze(-1).expand(*g.shape, 8), beta, s)
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(s1, s2)


@pytest.mark.parametrize("T", [1, 8, 9, 63, 130], ids=lambda t: f"T{t}")
def test_cpu_path_of_the_dispatcher(T, close):
    """On CPU tensors the dispatcher runs the C++ token loop (kernels/kda/native.py, one decay per head), or
    without the library KDA's recurrent (T <= 8) or chunked form with the decay repeated."""
    from localmoe.kernels.gated_delta import gated_delta

    args = _inputs(1, T, 2, 16, 24, seed=T + 7)
    o_ref, s_ref = naive_recurrent_gated_delta(*args)
    o, s = gated_delta(*args)
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 5], ids=lambda t: f"T{t}")
def test_fused_recurrent(T, dtype, device, close):
    from localmoe.kernels.gated_delta.triton import fused_recurrent_gated_delta

    args = _inputs(2, T, 2, 32, 48, seed=T, dtype=dtype)
    o_ref, s_ref = naive_recurrent_gated_delta(*[a.float() for a in args])
    o, s = fused_recurrent_gated_delta(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("T", [1, 63, pytest.param(500, marks=pytest.mark.slow)], ids=lambda t: f"T{t}")
def test_chunk(T, device, close):
    from localmoe.kernels.gated_delta.triton import chunk_gated_delta

    args = _inputs(1, T, 2, 32, 32, seed=T + 1)
    o_ref, s_ref = naive_recurrent_gated_delta(*args)
    o, s = chunk_gated_delta(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")
