"""KDA Triton kernels (recurrent decode, chunked prefill) against the token-by-token reference,
and the engine's chunked form against the same reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels.kda.reference import naive_recurrent_kda

from .conftest import TRITON_DEVICES


def _inputs(B, T, H, K, V, seed, dtype=torch.float32, steep=False, per_head=False):
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    shape = (B, T, H, 1) if per_head else (B, T, H, K)
    g = -torch.rand(*shape, generator=g_) * (8.0 if steep else 0.3)  # steep: decays down to e^-8 per step
    beta = torch.rand(B, T, H, generator=g_)
    state = torch.randn(B, H, K, V, generator=g_) * 0.1
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [state]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 2, 32, 32), (2, 3, 1, 24, 40), (1, 8, 3, 64, 16)],
                         ids=lambda *a: None)
def test_fused_recurrent(B, T, H, K, V, dtype, device, close):
    from localmoe.kernels.kda.triton import fused_recurrent_kda

    args = _inputs(B, T, H, K, V, seed=T * 7 + K, dtype=dtype)
    o_ref, s_ref = naive_recurrent_kda(*[a.float() for a in args])
    o, s = fused_recurrent_kda(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


CHUNK_CASES = [pytest.param(1, 1, 1, 32, 32, False, id="T1"), pytest.param(1, 63, 2, 32, 24, False, id="T63"),
               pytest.param(2, 70, 1, 16, 16, True, id="T70-steep-B2"),
               pytest.param(1, 500, 1, 32, 32, False, id="T500", marks=pytest.mark.slow)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("B,T,H,K,V,steep", CHUNK_CASES)
def test_chunk(B, T, H, K, V, steep, device, close):
    from localmoe.kernels.kda.triton import chunk_kda

    args = _inputs(B, T, H, K, V, seed=T + K, steep=steep)
    o_ref, s_ref = naive_recurrent_kda(*args)
    o, s = chunk_kda(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T{t}")
def test_engine_chunked_matches_reference(T, close):
    """The CPU prefill path (kernels/kda/cpu.py, as the engine reaches it) against the same spec."""
    from localmoe.engine.layers.kda import chunk_kda as engine_chunk

    args = _inputs(1, T, 2, 32, 32, seed=T)
    o_ref, s_ref = naive_recurrent_kda(*args)
    o, s = engine_chunk(*args)
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")
