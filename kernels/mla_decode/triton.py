"""Absorbed MLA decode in Triton: one program per (batch, BH heads), streaming the shared latent
rows in tiles of BS with an online softmax (fp32), dense (s < length) or over a top-k index set
(DSA), where the tile's rows are gathered through the indices."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _mla_decode_kernel(q_ptr, rows_ptr, len_ptr, idx_ptr, o_ptr, H, S, R, P, NI, scale,
                       sq_b, sq_h, sr_b, sr_s, si_b, so_b, so_h,
                       SPARSE: tl.constexpr, BH: tl.constexpr, BS: tl.constexpr, BR: tl.constexpr,
                       BP: tl.constexpr):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = heads < H
    offs_r = tl.arange(0, BR)
    offs_p = tl.arange(0, BP)
    mr, mp = offs_r < R, offs_p < P
    q_base = q_ptr + b * sq_b + heads[:, None] * sq_h
    q_lat = tl.load(q_base + offs_r[None, :], mask=mh[:, None] & mr[None, :], other=0.0).to(tl.float32)
    q_rope = tl.load(q_base + R + offs_p[None, :], mask=mh[:, None] & mp[None, :], other=0.0).to(tl.float32)
    m_i = tl.full((BH,), -1e30, dtype=tl.float32)  # finite: a fully masked tile gives p = 0, not NaN
    l_i = tl.zeros((BH,), dtype=tl.float32)
    acc = tl.zeros((BH, BR), dtype=tl.float32)
    n = NI if SPARSE else tl.load(len_ptr + b)
    for s0 in range(0, n, BS):
        j = s0 + tl.arange(0, BS)
        if SPARSE:
            pos = tl.load(idx_ptr + b * si_b + j, mask=j < n, other=-1)
            valid = (pos >= 0) & (pos < S)
        else:
            pos = j
            valid = j < n
        pos = tl.where(valid, pos, 0)
        r_base = rows_ptr + b * sr_b + pos[:, None] * sr_s
        c = tl.load(r_base + offs_r[None, :], mask=valid[:, None] & mr[None, :], other=0.0).to(tl.float32)  # [BS, BR]
        kr = tl.load(r_base + R + offs_p[None, :], mask=valid[:, None] & mp[None, :], other=0.0).to(tl.float32)
        scores = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
        scores += tl.dot(q_rope, tl.trans(kr), input_precision="ieee")
        scores = tl.where(valid[None, :], scores * scale, float("-inf"))  # [BH, BS]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, c, input_precision="ieee")
        m_i = m_new
    o = acc / l_i[:, None]
    tl.store(o_ptr + b * so_b + heads[:, None] * so_h + offs_r[None, :], o, mask=mh[:, None] & mr[None, :])


def _launch(q, rows, lengths, indices, latent_dim: int, scale: float, block_h: int = 16, block_s: int = 32):
    B, H, D = q.shape
    S = rows.shape[1]
    R, P = latent_dim, D - latent_dim
    assert rows.shape == (B, S, D) and q.stride(2) == 1 and rows.stride(2) == 1, "q [B, H, R+P], rows [B, S, R+P]"
    assert P >= 1, "the rows need a rope part"
    o = torch.empty(B, H, R, dtype=torch.float32, device=q.device)
    sparse = indices is not None
    idx = indices.to(torch.int32).contiguous() if sparse else torch.zeros(1, 1, dtype=torch.int32, device=q.device)
    lens = lengths.to(torch.int32).contiguous() if lengths is not None else torch.zeros(1, dtype=torch.int32,
                                                                                          device=q.device)
    grid = (B, triton.cdiv(H, block_h))
    _mla_decode_kernel[grid](q, rows, lens, idx, o, H, S, R, P, idx.shape[1], scale, q.stride(0), q.stride(1),
                             rows.stride(0), rows.stride(1), idx.stride(0), o.stride(0), o.stride(1),
                             SPARSE=sparse, BH=block_h, BS=block_s, BR=max(16, triton.next_power_of_2(R)),
                             BP=max(16, triton.next_power_of_2(P)))
    return o


def mla_decode(q, rows, lengths, latent_dim: int, scale: float) -> torch.Tensor:
    """Dense: q [B, H, R+P], rows [B, S, R+P], lengths [B] -> o [B, H, R] fp32."""
    return _launch(q, rows, lengths, None, latent_dim, scale)


def mla_decode_sparse(q, rows, indices, latent_dim: int, scale: float) -> torch.Tensor:
    """Over a top-k index set: indices [B, K] (-1 = unused) -> o [B, H, R] fp32."""
    return _launch(q, rows, None, indices, latent_dim, scale)
