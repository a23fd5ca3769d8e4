"""The CPU fast path: `gqa_cpu.cpp` (AVX2 + FMA) in the localmoe CPU library (kernels/_cpu)."""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads

MAX_DIM = 512


def supported(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (fp32 on the CPU, rows contiguous, D % 8 == 0)."""
    D = q.shape[-1]
    return (q.device.type == keys.device.type == values.device.type == "cpu"
            and q.dtype == keys.dtype == values.dtype == torch.float32 and D % 8 == 0 and D <= MAX_DIM
            and q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1 and library() is not None)


def gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
               visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As reference.naive_gqa_decode; q [B, H, D], keys/values [B, Hkv, S, D] through their strides."""
    B, H, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    assert H % Hkv == 0 and values.shape == keys.shape and keys.shape[-1] == D, "q [B, H, D], k/v [B, Hkv, S, D]"
    if visible is not None:
        visible = visible.to(torch.bool).contiguous()
        assert tuple(visible.shape) == (B, S), f"visible {tuple(visible.shape)} against [{B}, {S}]"
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = q.new_empty(B, H, D)
    library().gqa_decode(q.data_ptr(), q.stride(0), q.stride(1), B, H, H // Hkv, D,
                         keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                         values.data_ptr(), values.stride(0), values.stride(1), values.stride(2), first, S,
                         None if visible is None else visible.data_ptr(), S,
                         None if sinks is None else sinks.data_ptr(), scale, out.data_ptr(), threads())
    return out
