"""Training-free top-k attention for dense MLA/GQA layers at long context (`--sparse-topk N`).

The selector is exact: for each query (and head) it computes the real attention scores over
every cached key, keeps the N largest and gives the others probability 0 (score -inf) before
the softmax. It saves the softmax-weighted value reads (for MLA: the latent rows beyond the N
chosen), not the score computation itself; the logit change against dense attention is what
`benchmarks/long_context.py` reports. When N >= the keys a query can see, nothing is dropped
and the result equals dense attention exactly (callers skip selection then).

Ties at the N-th score: `torch.topk` keeps one of the tied keys, which one is unspecified.
"""

from __future__ import annotations

import torch


def keep_topk_scores(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [..., S] (masked keys already -inf) -> the same with all but the top_k largest per row set to -inf."""
    if top_k >= scores.shape[-1]:
        return scores
    idx = scores.topk(top_k, dim=-1).indices
    return torch.full_like(scores, float("-inf")).scatter_(-1, idx, scores.gather(-1, idx))


def topk_indices(scores: torch.Tensor, top_k: int) -> torch.Tensor:
    """scores [..., S] -> indices [..., min(top_k, S)] of the largest scores (which keys a query keeps)."""
    return scores.topk(min(top_k, scores.shape[-1]), dim=-1).indices
