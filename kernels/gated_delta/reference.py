"""Gated DeltaNet (Qwen3-Next), the spec in plain PyTorch: the delta rule with ONE decay per head.

Per head, state S [K, V], log-decay g (a scalar, <= 0), token by token:
    S <- exp(g) S ;  u = beta (v - S^T k) ;  S <- S + k u^T ;  o = S^T q
"""

from __future__ import annotations

import torch


def naive_recurrent_gated_delta(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                beta: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; state: [B, H, K, V] -> (o [B, T, H, V], state), fp32."""
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = state.float().clone()
    out = []
    for t in range(q.shape[1]):
        S = S * g[:, t].exp()[:, :, None, None]
        u = beta[:, t, :, None] * (v[:, t] - (k[:, t].unsqueeze(-1) * S).sum(-2))
        S = S + k[:, t].unsqueeze(-1) * u.unsqueeze(-2)
        out.append((q[:, t].unsqueeze(-1) * S).sum(-2))
    return torch.stack(out, dim=1), S
