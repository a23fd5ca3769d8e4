"""Absorbed MLA attention for a prompt chunk on CPU tensors through the localmoe CPU library (kernels/_cpu:
kernels/decode_layers/hybrid_prefill.cpp `mla_chunk`): one call per layer between the projections. Each query runs
the fused decode step's arithmetic (hybrid_mixers.h `mla_heads`: W_uk^T q_nope, the online softmax over the latent
rows 64 keys a block from key 0, W_uv), 8 queries of a head at a time sharing each weight and key row load, so a
query's bits do not depend on the chunk it comes in or on the thread count.
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads


def available(q: torch.Tensor) -> bool:
    """Whether `mla_chunk` runs for queries q: a CPU tensor, the library built."""
    return q.device.type == "cpu" and library() is not None


def mla_chunk(q: torch.Tensor, rows: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor,
              scale: float) -> torch.Tensor:
    """q [B, T, H, nope + rope] fp32 (the rope part as cached), rows [B, S, r + rope] fp32 (S >= T; each row's
    [S, r + rope] contiguous), w_uk [H, nope, r], w_uv [H, v, r] fp32 contiguous -> out [B, T, H v]: query t (position
    S - T + t) attends causally to rows 0 .. S - T + t, softmax(q . (W_uk c, k_rope) * scale) (W_uv c)."""
    B, T, H, qd = q.shape
    S, R = rows.shape[1], rows.shape[2]
    _, nope, r = w_uk.shape
    v = w_uv.shape[1]
    q = q.float().contiguous()
    assert rows.dtype == torch.float32 and rows.stride(2) == 1 and rows.stride(1) == R and S >= T
    assert qd == nope + R - r and w_uv.shape == (H, v, r) and w_uk.is_contiguous() and w_uv.is_contiguous()
    out = q.new_empty(B, T, H * v)
    library().mla_chunk(q.data_ptr(), rows.data_ptr(), rows.stride(0), B, T, S, w_uk.data_ptr(), w_uv.data_ptr(), H, r,
                        nope, R - r, v, scale, out.data_ptr(), threads())
    return out
