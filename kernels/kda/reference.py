"""Kimi Delta Attention (gated delta rule with a per-channel decay), the spec in plain PyTorch.

Per head, with an fp32 state S [K, V] and log-decay g [K] (g <= 0), token by token:
    S <- diag(exp(g)) S ;  u = beta (v - S^T k) ;  S <- S + k u^T ;  o = S^T q
q and k arrive normalised (and q scaled); the kernels take them as they are.
"""

from __future__ import annotations

import torch


def naive_recurrent_kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V].

    Returns (o [B, T, H, V] fp32, final state [B, H, K, V] fp32). g may be [B, T, H, 1] (one decay
    per head: Gated DeltaNet) and broadcasts over K.
    """
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp().unsqueeze(-1)  # [B, H, K, V]
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhk,bhkv->bhv", k[:, t], S))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))
    return torch.stack(out, dim=1), S
