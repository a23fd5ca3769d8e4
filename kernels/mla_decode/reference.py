"""Absorbed MLA decode over the latent cache, the spec in plain PyTorch (fp32).

All heads share one cached row per token, rows [B, S, R + P] = [latent c (R) | rope key k_r (P)].
The absorbed query per head is q [B, H, R + P] = [W_uk^T q_nope | q_rope], so
    score[b, h, s] = scale * q[b, h] . rows[b, s]        o[b, h] = softmax_s(score) @ c[b]   [B, H, R]
(W_uv is applied by the caller). Dense: s < lengths[b]. Sparse (DSA): s in indices[b] (-1 = unused).
"""

from __future__ import annotations

import torch


def naive_mla_decode(q: torch.Tensor, rows: torch.Tensor, lengths: torch.Tensor, latent_dim: int,
                     scale: float) -> torch.Tensor:
    """q [B, H, R+P], rows [B, S, R+P], lengths [B] (>= 1) -> o [B, H, R] fp32."""
    S = rows.shape[1]
    scores = torch.einsum("bhd,bsd->bhs", q.float(), rows.float()) * scale
    valid = torch.arange(S, device=q.device)[None, :] < lengths[:, None]  # [B, S]
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    return scores.softmax(-1) @ rows[..., :latent_dim].float()


def naive_mla_decode_sparse(q: torch.Tensor, rows: torch.Tensor, indices: torch.Tensor, latent_dim: int,
                            scale: float) -> torch.Tensor:
    """q [B, H, R+P], rows [B, S, R+P], indices [B, K] int (-1 = unused; at least one used) -> o [B, H, R] fp32."""
    B = rows.shape[0]
    picked = rows[torch.arange(B, device=rows.device)[:, None], indices.clamp(min=0).long()]  # [B, K, R+P]
    scores = torch.einsum("bhd,bkd->bhk", q.float(), picked.float()) * scale
    scores = scores.masked_fill((indices < 0)[:, None], float("-inf"))
    return scores.softmax(-1) @ picked[..., :latent_dim].float()
