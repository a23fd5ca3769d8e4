"""KDA dispatcher: Triton on GPU tensors, the vectorised PyTorch forms of cpu.py elsewhere; the
recurrent form for a few tokens (decode), the chunked one for prefill."""

from __future__ import annotations

from localmoe.kernels._triton import usable
from localmoe.kernels.kda import cpu
from localmoe.kernels.kda.reference import naive_recurrent_kda

RECURRENT_MAX_T = 8  # calls of at most this many tokens use the recurrent kernel


def recurrent_kda(q, k, v, g, beta, state):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V] -> (o, state) fp32."""
    if usable(q):
        from localmoe.kernels.kda.triton import fused_recurrent_kda

        return fused_recurrent_kda(q, k, v, g, beta, state)
    return cpu.recurrent_kda(q, k, v, g, beta, state)


def chunk_kda(q, k, v, g, beta, state):
    """The chunked form (prefill). Same contract as `recurrent_kda`."""
    if usable(q):
        from localmoe.kernels.kda import triton as tk

        return tk.chunk_kda(q, k, v, g, beta, state)
    return cpu.chunk_kda(q, k, v, g, beta, state)


def kda(q, k, v, g, beta, state):
    """Recurrent for T <= RECURRENT_MAX_T, chunked above."""
    return (recurrent_kda if q.shape[1] <= RECURRENT_MAX_T else chunk_kda)(q, k, v, g, beta, state)


__all__ = ["chunk_kda", "kda", "naive_recurrent_kda", "recurrent_kda"]
