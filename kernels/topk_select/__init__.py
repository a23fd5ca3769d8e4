"""DSA indexer top-k dispatcher: Triton scoring on GPU tensors, else the CPU form (cpu.py: the reference's
scores one block of keys at a time, a running top-k across blocks)."""

from __future__ import annotations

from localmoe.kernels._triton import usable
from localmoe.kernels.topk_select.cpu import blockwise_topk_select
from localmoe.kernels.topk_select.reference import naive_indexer_scores, naive_topk_select, select_topk, top_columns


def topk_select(q, w, k, positions, top_k: int):
    """q [B, T, H, D], w [B, T, H], k [B, S, D], positions [B, T] -> indices [B, T, top_k] (-1 pads)."""
    if usable(q):
        from localmoe.kernels.topk_select import triton as tk

        return tk.topk_select(q, w, k, positions, top_k)
    return blockwise_topk_select(q, w, k, positions, top_k)


__all__ = ["blockwise_topk_select", "naive_indexer_scores", "naive_topk_select", "select_topk", "top_columns", "topk_select"]
