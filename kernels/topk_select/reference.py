"""DSA lightning-indexer scoring and top-k selection (DeepSeek-V3.2), the spec in plain PyTorch.

Each query token has H index heads q [H, D] and head weights w [H]; every cached token s has ONE
index key k_s [D]. score[t, s] = sum_h w[t, h] * relu(q[t, h] . k_s) for s <= pos[t] (causal),
else -inf; the query then attends to the top-k scoring cached tokens (-1 pads when fewer exist); of
equal scores the lower position is kept (`top_columns`).
"""

from __future__ import annotations

import torch


def naive_indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], w [B, T, H], k [B, S, D], positions [B, T] -> scores [B, T, S] fp32."""
    S = k.shape[1]
    scores = torch.einsum("bth,bths->bts", w.float(), torch.einsum("bthd,bsd->bths", q.float(), k.float()).relu())
    causal = torch.arange(S, device=k.device)[None, None, :] <= positions[..., None]
    return scores.masked_fill(~causal, float("-inf"))


def top_columns(scores: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [..., L] -> (columns [..., k], kept [..., k]) with k = min(top_k, L): the columns of the k best
    finite scores in increasing column order (`kept` False on the padding after them, where fewer than k
    scores are finite).

    Tie rule (shared with the fused decode's C++ top-k, kernels/decode_layers/hybrid_mixers.h `top_rows`):
    a higher score first; of equal scores, the lower column first. So the chosen set is a function of the
    scores alone, never of the call's shape (relu zeros tie whenever fewer than k tokens score above 0)."""
    L = scores.shape[-1]
    k = min(top_k, L)
    if k == 0:
        empty = scores.new_empty((*scores.shape[:-1], 0), dtype=torch.long)
        return empty, empty.bool()
    kth = scores.topk(k, dim=-1).values[..., -1:]  # the k-th best score
    above, tied = scores > kth, scores == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied (lowest columns first) are kept
    keep = (above | (tied & (tied.cumsum(-1) <= room))) & (scores > float("-inf"))
    where = torch.where(keep, torch.arange(L, device=scores.device), L)
    columns = where.topk(k, dim=-1, largest=False).values  # increasing; L marks padding
    return columns.clamp(max=L - 1), columns < L


def select_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [B, T, S] -> indices [B, T, top_k] int64 of the best scores in increasing order, -1 pads where
    fewer than top_k are finite. Ties: `top_columns` (the lower position first), so the result depends on
    the scores only."""
    columns, kept = top_columns(scores, top_k)
    idx = columns.masked_fill(~kept, -1)
    if idx.shape[-1] < top_k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], top_k - idx.shape[-1]), -1)], dim=-1)
    return idx


def naive_topk_select(q, w, k, positions, top_k: int) -> torch.Tensor:
    """Indexer scores then top-k: [B, T, top_k] int64."""
    return select_topk(naive_indexer_scores(q, w, k, positions), top_k)
