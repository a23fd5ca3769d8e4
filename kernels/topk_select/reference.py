"""DSA lightning-indexer scoring and top-k selection (DeepSeek-V3.2), the spec in plain PyTorch.

Each query token has H index heads q [H, D] and head weights w [H]; every cached token s has ONE
index key k_s [D]. score[t, s] = sum_h w[t, h] * relu(q[t, h] . k_s) for s <= pos[t] (causal),
else -inf; the query then attends to the top-k scoring cached tokens (-1 pads when fewer exist).
"""

from __future__ import annotations

import torch


def naive_indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q [B, T, H, D], w [B, T, H], k [B, S, D], positions [B, T] -> scores [B, T, S] fp32."""
    S = k.shape[1]
    scores = torch.einsum("bth,bths->bts", w.float(), torch.einsum("bthd,bsd->bths", q.float(), k.float()).relu())
    causal = torch.arange(S, device=k.device)[None, None, :] <= positions[..., None]
    return scores.masked_fill(~causal, float("-inf"))


def select_topk(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [B, T, S] -> indices [B, T, top_k] int64 of the best scores (-1 where only -inf is left).

    Tie rule: that of `torch.topk`, as transformers' DSA uses it: every token scoring above the
    k-th best score is kept, and where several share the k-th score (e.g. relu zeros when fewer
    than k tokens score above 0) which of them are kept is unspecified (it can depend on the
    call's shape). So the chosen scores, as a multiset, are exactly the k best; the order within
    the result is unspecified too: callers treat it as a set."""
    k = min(top_k, scores.shape[-1])
    values, idx = scores.topk(k, dim=-1)
    idx = idx.masked_fill(values == float("-inf"), -1)
    if k < top_k:
        idx = torch.cat([idx, idx.new_full((*idx.shape[:-1], top_k - k), -1)], dim=-1)
    return idx


def naive_topk_select(q, w, k, positions, top_k: int) -> torch.Tensor:
    """Indexer scores then top-k: [B, T, top_k] int64."""
    return select_topk(naive_indexer_scores(q, w, k, positions), top_k)
