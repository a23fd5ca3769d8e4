"""Grouped-query attention decode dispatcher (one new query per sequence): the CPU kernel for fp32
CPU tensors where the library is built, else the reference."""

from __future__ import annotations

import torch
from localmoe.kernels.gqa_decode import cpu
from localmoe.kernels.gqa_decode.reference import naive_gqa_decode


def gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
               visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], keys/values [B, Hkv, S, D] -> [B, H, D] fp32 (see reference.naive_gqa_decode)."""
    if cpu.supported(q, keys, values):
        return cpu.gqa_decode(q, keys, values, scale, first, visible, sinks)
    return naive_gqa_decode(q, keys, values, scale, first, visible, sinks)


__all__ = ["gqa_decode", "naive_gqa_decode"]
