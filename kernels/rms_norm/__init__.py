"""Residual add + RMSNorm dispatcher: the CPU kernel (norm_cpu.cpp) for contiguous fp32 CPU
tensors where the library is built, else the reference."""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library
from localmoe.kernels.rms_norm.reference import naive_add_rms_norm


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] fp32 += delta (in place, when given); returns rms_norm(x) * weight as a new tensor.
    `weight` [D] must be fp32 and contiguous for the kernel (the engine keeps its norms so)."""
    if (x.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
            and (delta is None or (delta.dtype == torch.float32 and delta.is_contiguous() and delta.shape == x.shape))
            and weight.dtype == torch.float32 and weight.is_contiguous() and weight.numel() == x.shape[-1]):
        lib = library()
        if lib is not None:
            out = torch.empty_like(x)
            D = x.shape[-1]
            lib.add_rms_norm(x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                             x.numel() // D, D, eps, out.data_ptr())
            return out
    return naive_add_rms_norm(x, delta, weight, eps)


__all__ = ["add_rms_norm", "naive_add_rms_norm"]
