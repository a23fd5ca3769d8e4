"""Grouped-query attention for one new query per sequence, the spec in plain PyTorch (fp32)."""

from __future__ import annotations

import torch


def naive_gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
                     visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; keys, values [B, Hkv, S, D] (query head h reads KV head h // (H / Hkv)) -> [B, H, D].

    Attends to keys first .. S-1 that `visible` [B, S] (bool, None = all) allows, softmax of
    q.k * scale; `sinks` [H]: one more logit per head in the softmax's denominator, with no value.
    A head that sees no key and has no sink gets zeros.
    """
    B, H = q.shape[:2]
    group = H // keys.shape[1]
    k = keys[:, :, first:].float().repeat_interleave(group, dim=1)  # [B, H, S', D]
    v = values[:, :, first:].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, first:], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, H, 1).expand(B, H, 1)], dim=-1)
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # a head that sees nothing: all -inf
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhs,bhsd->bhd", probs, v)
