"""Absorbed MLA decode (dense and over top-k indices): Triton against the reference, and the
reference against the expanded (per-head K/V) attention it is an algebraic rewrite of."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels.mla_decode.reference import naive_mla_decode, naive_mla_decode_sparse

from .conftest import TRITON_DEVICES


def _inputs(B, H, S, R, P, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, R + P, generator=g)
    rows = torch.randn(B, S, R + P, generator=g)
    lengths = torch.randint(1, S + 1, (B,), generator=g)
    lengths[0] = S
    return q.to(dtype), rows.to(dtype), lengths


def test_reference_equals_expanded_attention():
    """o_h W_uv^T from the absorbed form == softmax((q_nope W_uk c + q_r k_r)) (W_uv c) per head."""
    B, H, S, R, P, N, Vd = 2, 3, 9, 16, 8, 12, 10
    g = torch.Generator().manual_seed(0)
    w_uk, w_uv = torch.randn(H, N, R, generator=g, dtype=torch.float64), torch.randn(H, Vd, R, generator=g,
                                                                                      dtype=torch.float64)
    q_nope, q_rope = torch.randn(B, H, N, generator=g, dtype=torch.float64), torch.randn(B, H, P, generator=g,
                                                                                         dtype=torch.float64)
    rows = torch.randn(B, S, R + P, generator=g, dtype=torch.float64)
    lengths = torch.tensor([S, 4])
    scale = (N + P) ** -0.5
    q = torch.cat([torch.einsum("bhn,hnr->bhr", q_nope, w_uk), q_rope], dim=-1)
    got = torch.einsum("bhr,hvr->bhv", naive_mla_decode(q, rows, lengths, R, scale).double(), w_uv)
    for b in range(B):
        c, kr = rows[b, :lengths[b], :R], rows[b, :lengths[b], R:]
        for h in range(H):
            keys = torch.cat([c @ w_uk[h].T, kr], dim=-1)  # [S, N + P]
            p = ((keys @ torch.cat([q_nope[b, h], q_rope[b, h]])) * scale).softmax(0)
            torch.testing.assert_close(got[b, h], p @ (c @ w_uv[h].T), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,H,S,R,P", [(1, 1, 1, 32, 16), (2, 5, 63, 64, 16), (1, 16, 500, 128, 64)],
                         ids=lambda *a: None)
def test_dense(B, H, S, R, P, dtype, device, close):
    from localmoe.kernels.mla_decode.triton import mla_decode

    q, rows, lengths = _inputs(B, H, S, R, P, seed=S, dtype=dtype)
    want = naive_mla_decode(q.float(), rows.float(), lengths, R, (R + P) ** -0.5)
    got = mla_decode(q.to(device), rows.to(device), lengths.to(device), R, (R + P) ** -0.5)
    close(got, want, 1e-5, "o")


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("B,H,S,K", [(1, 2, 10, 1), (2, 3, 200, 63), (1, 4, 500, 100)], ids=lambda *a: None)
def test_sparse(B, H, S, K, device, close):
    from localmoe.kernels.mla_decode.triton import mla_decode_sparse

    R, P = 64, 16
    q, rows, _ = _inputs(B, H, S, R, P, seed=K)
    g = torch.Generator().manual_seed(K)
    indices = torch.stack([torch.randperm(S, generator=g)[:K] for _ in range(B)])
    if K > 2:
        indices[-1, -K // 3:] = -1  # unused slots
    want = naive_mla_decode_sparse(q, rows, indices, R, 0.1)
    close(mla_decode_sparse(q.to(device), rows.to(device), indices.to(device), R, 0.1), want, 1e-5, "o")
