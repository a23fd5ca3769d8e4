"""DSA indexer top-k on CPU tensors, one block of cached keys at a time.

The reference scores every query against every cached key at once: [B, T, H, S] head scores,
which for a long prefill chunk grow with the context (T = 512 queries, H = 64 index heads and
S = 128k keys would be 16 GiB). Here the keys run in blocks whose head scores take at most
`max_bytes`; after each block the best `top_k` of (the best so far, the block's scores) are
kept, so memory is set by the block and top_k, not by S. Each score is the reference's
formula, and the kept candidates stay in increasing position order, so the reference's tie rule
(`reference.top_columns`: of equal scores the lower position) picks the same set as one call over
all keys.
"""

from __future__ import annotations

import torch
from localmoe.kernels.topk_select.reference import naive_indexer_scores, select_topk, top_columns

BLOCK_MAX_BYTES = 32 << 20  # fp32 head scores [B, T, H, block] of one key block


def blockwise_topk_select(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, top_k: int,
                          max_bytes: int = BLOCK_MAX_BYTES) -> torch.Tensor:
    """q [B, T, H, D], w [B, T, H], k [B, S, D], positions [B, T] -> indices [B, T, top_k] int64 (-1 pads)."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    block = max(top_k, max_bytes // (4 * B * T * H))
    if block >= S:
        return select_topk(naive_indexer_scores(q, w, k, positions), top_k)
    best, where = None, None  # [B, T, <= top_k] best scores so far and their key indices (increasing)
    for lo in range(0, S, block):
        hi = min(S, lo + block)
        scores = naive_indexer_scores(q, w, k[:, lo:hi], positions - lo)  # [B, T, hi - lo]
        index = torch.arange(lo, hi, device=k.device).expand(B, T, -1)
        if best is not None:
            scores, index = torch.cat([best, scores], dim=-1), torch.cat([where, index], dim=-1)
        columns, kept = top_columns(scores, top_k)
        best = scores.gather(-1, columns).masked_fill(~kept, float("-inf"))
        where = index.gather(-1, columns)
        del scores, index
    where = where.masked_fill(best == float("-inf"), -1)
    if where.shape[-1] < top_k:
        where = torch.cat([where, where.new_full((B, T, top_k - where.shape[-1]), -1)], dim=-1)
    return where
