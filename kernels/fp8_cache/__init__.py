"""FP8 cache block dispatcher: Triton on GPU tensors, else the reference. Rows of any leading
shape: x [..., D] -> (q [..., D], scale [...])."""

from __future__ import annotations

import torch
from localmoe.kernels._triton import usable
from localmoe.kernels.fp8_cache.reference import FP8_MAX, naive_dequantize_fp8, naive_quantize_fp8


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (float8_e4m3fn [..., D], fp32 scale [...]), one scale per row of D values."""
    lead, D = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, D)
    if usable(x):
        from localmoe.kernels.fp8_cache import triton as tk

        q, s = tk.quantize_fp8(rows.contiguous() if rows.stride(-1) != 1 else rows)
    else:
        q, s = naive_quantize_fp8(rows)
    return q.view(*lead, D), s.view(lead)


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8`: [..., D] of dtype."""
    lead, D = q.shape[:-1], q.shape[-1]
    if usable(q):
        from localmoe.kernels.fp8_cache import triton as tk

        return tk.dequantize_fp8(q.reshape(-1, D).contiguous(), scale.reshape(-1), dtype).view(*lead, D)
    return naive_dequantize_fp8(q.reshape(-1, D), scale.reshape(-1), dtype).view(*lead, D)


__all__ = ["FP8_MAX", "dequantize_fp8", "naive_dequantize_fp8", "naive_quantize_fp8", "quantize_fp8"]
