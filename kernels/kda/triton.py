"""KDA in Triton: `fused_recurrent_kda` (decode: the state lives in registers across the tokens)
and `chunk_kda` (prefill: chunks of 64 tokens, the delta-rule updates of a chunk solved at once).

Both keep one program per (batch, head, V tile) with the [K, BV] state tile in fp32 registers.
Chunk form (positions i, j in a chunk; G = cumulative log-decay per channel; S0 the state in):
    A[i, j] = beta_i k_i . (exp(G_i - G_j) k_j)  (j < i)    P[i, j] = q_i . (exp(G_i - G_j) k_j)  (j <= i)
    (I + A) U = beta (V - (k exp(G)) S0)                       forward substitution, row by row
    O = (q exp(G)) S0 + P U ;   S = exp(G_C) S0 + (k exp(G_C - G))^T U
Every exponent G_i - G_j (j <= i) and G_C - G is <= 0, so nothing overflows for any decay.
`g` may have a K stride of 0 (one decay per head: Gated DeltaNet, kernels/gated_delta).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 64


@triton.jit
def _recurrent_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, so_ptr, T, H, K, V,
                      sq_b, sq_t, sq_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sg_k, sb_b, sb_t, sb_h,
                      BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    mk, mv = offs_k < K, offs_v < V
    m2 = mk[:, None] & mv[None, :]
    s_off = (bh * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(s_ptr + s_off, mask=m2, other=0.0).to(tl.float32)
    for t in range(T):
        qk_off = b * sq_b + t * sq_t + h * sq_h + offs_k
        q = tl.load(q_ptr + qk_off, mask=mk, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + qk_off, mask=mk, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sg_b + t * sg_t + h * sg_h + offs_k * sg_k, mask=mk, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + offs_v, mask=mv, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + b * sb_b + t * sb_t + h * sb_h).to(tl.float32)
        S = S * tl.exp(g)[:, None]
        u = beta * (v - tl.sum(k[:, None] * S, axis=0))
        S = S + k[:, None] * u[None, :]
        o = tl.sum(q[:, None] * S, axis=0)
        tl.store(o_ptr + ((b * T + t) * H + h) * V + offs_v, o, mask=mv)
    tl.store(so_ptr + s_off, S, mask=m2)


@triton.jit
def _chunk_kernel(q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, o_ptr, so_ptr, T, H, K, V,
                  sq_b, sq_t, sq_h, sv_b, sv_t, sv_h, sg_b, sg_t, sg_h, sg_k, sb_b, sb_t, sb_h,
                  BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr):
    bh = tl.program_id(0)
    b, h = bh // H, bh % H
    offs_k = tl.arange(0, BK)
    offs_v = tl.program_id(1) * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    mk, mv = offs_k < K, offs_v < V
    s_off = (bh * K + offs_k[:, None]) * V + offs_v[None, :]
    S = tl.load(s_ptr + s_off, mask=mk[:, None] & mv[None, :], other=0.0).to(tl.float32)
    for t0 in range(0, T, BT):
        t = t0 + rows
        mt = t < T
        mtk = mt[:, None] & mk[None, :]
        qk_off = b * sq_b + t[:, None] * sq_t + h * sq_h + offs_k[None, :]
        q = tl.load(q_ptr + qk_off, mask=mtk, other=0.0).to(tl.float32)  # [BT, BK]; padding: q = k = g = beta = 0
        k = tl.load(k_ptr + qk_off, mask=mtk, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + b * sg_b + t[:, None] * sg_t + h * sg_h + offs_k[None, :] * sg_k, mask=mtk,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + b * sv_b + t[:, None] * sv_t + h * sv_h + offs_v[None, :],
                    mask=mt[:, None] & mv[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        beta = tl.load(b_ptr + b * sb_b + t * sb_t + h * sb_h, mask=mt, other=0.0).to(tl.float32)
        G = tl.cumsum(g, axis=0)
        A = tl.zeros((BT, BT), dtype=tl.float32)
        P = tl.zeros((BT, BT), dtype=tl.float32)
        for j in range(BT):  # column j of A and P: exp(G_i - G_j) only where j <= i (<= 0 there)
            sel = (rows == j)[:, None]
            kj = tl.sum(tl.where(sel, k, 0.0), axis=0)  # [BK]
            Gj = tl.sum(tl.where(sel, G, 0.0), axis=0)
            below = rows >= j
            D = tl.exp(tl.where(below[:, None], G - Gj[None, :], float("-inf")))  # [BT, BK]
            kd = D * kj[None, :]
            colsel = (rows == j)[None, :]
            A = tl.where(colsel, tl.sum(k * kd, axis=1)[:, None], A)
            P = tl.where(colsel, tl.sum(q * kd, axis=1)[:, None], P)
        A = tl.where(rows[:, None] > rows[None, :], A * beta[:, None], 0.0)
        eG = tl.exp(G)
        U = beta[:, None] * (v - tl.dot(k * eG, S, input_precision="ieee"))  # right-hand side [BT, BV]
        for i in range(1, BT):  # forward substitution: U_i -= sum_{j<i} A[i, j] U_j
            a_i = tl.sum(tl.where((rows == i)[:, None], A, 0.0), axis=0)  # row i of A, over j
            u_i = tl.sum(tl.where((rows == i)[:, None], U, 0.0), axis=0) - tl.sum(a_i[:, None] * U, axis=0)
            U = tl.where((rows == i)[:, None], u_i[None, :], U)
        P = tl.where(rows[:, None] >= rows[None, :], P, 0.0)
        o = tl.dot(q * eG, S, input_precision="ieee") + tl.dot(P, U, input_precision="ieee")
        tl.store(o_ptr + ((b * T + t[:, None]) * H + h) * V + offs_v[None, :], o, mask=mt[:, None] & mv[None, :])
        G_end = tl.sum(tl.where((rows == tl.minimum(T - t0, BT) - 1)[:, None], G, 0.0), axis=0)  # [BK]
        kdec = tl.where(mt[:, None], k * tl.exp(G_end[None, :] - G), 0.0)
        S = tl.exp(G_end)[:, None] * S + tl.dot(tl.trans(kdec), U, input_precision="ieee")
    tl.store(so_ptr + s_off, S, mask=mk[:, None] & mv[None, :])


def _launch(kernel, q, k, v, g, beta, state, **consts):
    B, T, H, K = k.shape
    V = v.shape[-1]
    assert q.shape == k.shape and v.shape[:3] == (B, T, H) and beta.shape == (B, T, H)
    assert g.shape[:3] == (B, T, H) and g.shape[3] in (1, K) and state.shape == (B, H, K, V)
    assert q.stride() == k.stride() and q.stride(3) == 1 and v.stride(3) == 1, "q, k alike; last dims contiguous"
    g_k = 0 if g.shape[3] == 1 else g.stride(3)
    state = state.float().contiguous()
    o = torch.empty(B, T, H, V, dtype=torch.float32, device=q.device)
    s_out = torch.empty_like(state)
    BK = triton.next_power_of_2(K)
    BV = min(triton.next_power_of_2(V), 64)
    grid = (B * H, triton.cdiv(V, BV))
    kernel[grid](q, k, v, g, beta, state, o, s_out, T, H, K, V, q.stride(0), q.stride(1), q.stride(2),
                 v.stride(0), v.stride(1), v.stride(2), g.stride(0), g.stride(1), g.stride(2), g_k,
                 beta.stride(0), beta.stride(1), beta.stride(2), BK=BK, BV=BV, **consts)
    return o, s_out


def fused_recurrent_kda(q, k, v, g, beta, state):
    """Token-by-token KDA (decode). Shapes as `reference.naive_recurrent_kda`; returns fp32 (o, state)."""
    return _launch(_recurrent_kernel, q, k, v, g, beta, state)


def chunk_kda(q, k, v, g, beta, state, chunk_size: int = CHUNK):
    """Chunked KDA (prefill), equal to the recurrent form. Shapes as `reference.naive_recurrent_kda`."""
    assert chunk_size >= 16 and chunk_size & (chunk_size - 1) == 0, "chunk_size: a power of two >= 16 (tl.dot)"
    if max(triton.next_power_of_2(k.shape[-1]), 16) != triton.next_power_of_2(k.shape[-1]):
        raise ValueError("chunk_kda needs K >= 16")
    return _launch(_chunk_kernel, q, k, v, g, beta, state, BT=chunk_size)
