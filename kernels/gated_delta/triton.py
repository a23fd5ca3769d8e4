"""Gated DeltaNet in Triton: the KDA kernels (kernels/kda/triton.py) with the per-head decay
broadcast over K through a zero stride (no [B, T, H, K] copy)."""

from __future__ import annotations

from localmoe.kernels.kda import triton as kda_triton


def fused_recurrent_gated_delta(q, k, v, g, beta, state):
    """Decode. q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; state: [B, H, K, V]."""
    return kda_triton.fused_recurrent_kda(q, k, v, g.unsqueeze(-1), beta, state)


def chunk_gated_delta(q, k, v, g, beta, state, chunk_size: int = kda_triton.CHUNK):
    """Prefill in chunks of 64; same contract as `fused_recurrent_gated_delta`."""
    return kda_triton.chunk_kda(q, k, v, g.unsqueeze(-1), beta, state, chunk_size)
