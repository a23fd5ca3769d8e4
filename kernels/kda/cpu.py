"""KDA on CPU tensors: the engine's vectorised PyTorch forms (the dispatcher's CPU path).

`recurrent_kda` is the token-by-token form (decode); `chunk_kda` the chunked (WY / UT
transform) form for prefill: within a chunk of C tokens the C delta-rule updates are one
unit-lower-triangular solve, and only the state crosses chunk boundaries. Both equal
`reference.naive_recurrent_kda` (tests/engine/test_kda.py, tests/kernels/test_kda.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # prefill chunk length


def recurrent_kda(q, k, v, g, beta, state):
    """Token-by-token KDA. q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state [B, H, K, V].

    q, k already normalised and q scaled. Returns (o [B, T, H, V], final state [B, H, K, V]), fp32.
    Per token the old state S is read by one matmul and then updated in place: with a = exp(g),
    (a k)^T S and (a q)^T S come together, and o = (a q)^T S + (q . k) u.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        a = g[:, t].exp()  # [B, H, K]
        kq = torch.stack([k[:, t], q[:, t]], dim=2) * a.unsqueeze(2)  # [B, H, 2, K]
        read = kq @ S  # [B, H, 2, V]: decayed S^T k and S^T q
        u = beta[:, t, :, None] * (v[:, t] - read[:, :, 0])
        out.append(read[:, :, 1] + (q[:, t] * k[:, t]).sum(-1, keepdim=True) * u)
        S.mul_(a.unsqueeze(-1)).addcmul_(k[:, t].unsqueeze(-1), u.unsqueeze(-2))  # no [K, V] temporary
    return torch.stack(out, dim=1), S


SUB = 16  # sub-block length inside a chunk: pairwise decays only within sub-blocks
# Inside a sub-block exp(G_0 - G_j) is formed directly while it stays below e^80 (fp32 max ~e^88.7):
# always for K3's bounded gate (15 steps of >= -5), else when the data allows; otherwise pairwise.
SAFE_EXP = 80.0


def chunk_kda(q, k, v, g, beta, state, chunk_size: int = CHUNK):
    """Chunked KDA, equal to `recurrent_kda` (same shapes and contract).

    Within a chunk (positions i, j; cumulative log-decay G_i = g_1 + ... + g_i, per channel),
    with S0 the state entering it:
      D[i, j] = exp(G_i - G_j) (j <= i, else 0)        per channel, never > 1 since g <= 0
      A[i, j] = beta_i * k_i . (D[i, j] * k_j)  (j < i)  strictly lower triangular
      (I + A) U = beta * (V - (k * exp(G)) S0)           the C delta-rule updates, one solve
      O = (q * exp(G)) S0 + P U,  P[i, j] = q_i . (D[i, j] * k_j)  (j <= i)
      S = exp(G_C) * S0 + (k * exp(G_C - G))^T U
    D is never materialised for the whole chunk. Across sub-blocks of SUB tokens, with r the
    last position of the earlier block, D[i, j] = exp(G_i - G_r) * exp(G_r - G_j), both
    factors <= 1 (no overflow for any gate), so those blocks of A and P are plain matmuls.
    Inside a sub-block the same split through its first position is a matmul too while
    exp(G_0 - G_j) fits in fp32 (SAFE_EXP); a steeper decay falls back to pairwise decays.
    """
    B, T, H, K = k.shape
    V = v.shape[-1]
    pad = -T % SUB  # zero tokens at the end (g = 0, k = 0, beta = 0) change neither outputs nor state
    q, k, v, g = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)).transpose(1, 2).contiguous() for t in (q, k, v, g))
    beta = F.pad(beta.float(), (0, 0, 0, pad)).transpose(1, 2)  # [B, H, T'] (q, k, v, g: [B, H, T', *])
    S = state.float()
    out = v.new_empty(v.shape)
    tril = torch.ones(SUB, SUB, dtype=torch.bool).tril()
    for s0 in range(0, T + pad, chunk_size):
        c = slice(s0, min(s0 + chunk_size, T + pad))
        qc, kc, vc, bc = q[:, :, c], k[:, :, c], v[:, :, c], beta[:, :, c, None]
        n = kc.shape[2]
        nb = n // SUB
        G = g[:, :, c].cumsum(dim=2)  # [B, H, n, K]
        Gb, kb, qb = (t.reshape(B, H, nb, SUB, -1) for t in (G, kc, qc))  # [B, H, nb, SUB, *]
        G0 = Gb[..., :1, :]  # each sub-block's first position
        if float((G0 - Gb).amax()) < SAFE_EXP:
            # Diagonal sub-blocks through their first position: exp(G_i - G0) <= 1, exp(G0 - G_j) < e^SAFE_EXP.
            right = (kb * (G0 - Gb).exp()).transpose(-1, -2)
            left = (Gb - G0).exp()
            A_diag, P_diag = (kb * left) @ right, ((qb * left) @ right).tril_()
        else:  # a steep decay: form [B, H, nb, SUB(i), SUB(j), K] pairwise decays times k_j
            kd = (Gb.unsqueeze(-2) - Gb.unsqueeze(-3)).masked_fill_(~tril[:, :, None], float("-inf"))
            kd = kd.exp_().mul_(kb.unsqueeze(-3))
            A_diag = torch.einsum("bhnijc,bhnic->bhnij", kd, kb)
            P_diag = torch.einsum("bhnijc,bhnic->bhnij", kd, qb)
        A = kc.new_zeros(B, H, n, n)
        P = kc.new_zeros(B, H, n, n)
        for blk in range(nb):
            d = slice(blk * SUB, (blk + 1) * SUB)
            A[:, :, d, d] = A_diag[:, :, blk]
            P[:, :, d, d] = P_diag[:, :, blk]
        # Blocks below the diagonal: every later row against sub-block `blk`, through r.
        for blk in range(nb - 1):
            cols, rows, r = slice(blk * SUB, (blk + 1) * SUB), slice((blk + 1) * SUB, n), (blk + 1) * SUB - 1
            Gr = G[:, :, r:r + 1]
            right = (kc[:, :, cols] * (Gr - G[:, :, cols]).exp()).transpose(-1, -2)  # [B, H, K, SUB]
            left = (G[:, :, rows] - Gr).exp()
            A[:, :, rows, cols] = (kc[:, :, rows] * left) @ right
            P[:, :, rows, cols] = (qc[:, :, rows] * left) @ right
        A = A.mul_(bc).tril_(-1)
        eG = G.exp()
        rhs = torch.cat([bc * vc, bc * (kc * eG)], dim=-1)
        Ub, W = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True).split((V, K), dim=-1)
        U = Ub - W @ S  # [B, H, n, V]
        out[:, :, c] = (qc * eG) @ S + P @ U
        G_end = G[:, :, -1:]  # [B, H, 1, K]
        S = G_end.transpose(-1, -2).exp() * S + (kc * (G_end - G).exp()).transpose(-1, -2) @ U
    return out[:, :, :T].transpose(1, 2), S
