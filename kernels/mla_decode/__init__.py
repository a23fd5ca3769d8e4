"""Absorbed MLA decode dispatcher: Triton on GPU tensors, else the reference. `mla_chunk` (native.py): a prompt
chunk's absorbed attention in one C++ call on the CPU, where `chunk_available`."""

from __future__ import annotations

from localmoe.kernels._triton import usable
from localmoe.kernels.mla_decode import native
from localmoe.kernels.mla_decode.reference import naive_mla_decode, naive_mla_decode_sparse


def mla_decode(q, rows, lengths, latent_dim: int, scale: float):
    """q [B, H, R+P], rows [B, S, R+P], lengths [B] -> o [B, H, R] fp32 (see reference.py)."""
    if usable(q):
        from localmoe.kernels.mla_decode import triton as tk

        return tk.mla_decode(q, rows, lengths, latent_dim, scale)
    return naive_mla_decode(q, rows, lengths, latent_dim, scale)


def mla_decode_sparse(q, rows, indices, latent_dim: int, scale: float):
    """As `mla_decode` over indices [B, K] (-1 = unused) instead of a prefix."""
    if usable(q):
        from localmoe.kernels.mla_decode import triton as tk

        return tk.mla_decode_sparse(q, rows, indices, latent_dim, scale)
    return naive_mla_decode_sparse(q, rows, indices, latent_dim, scale)


mla_chunk = native.mla_chunk  # a prompt chunk's attention over the latent rows, where `chunk_available`
chunk_available = native.available

__all__ = ["chunk_available", "mla_chunk", "mla_decode", "mla_decode_sparse", "naive_mla_decode",
           "naive_mla_decode_sparse"]
