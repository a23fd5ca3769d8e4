"""MXFP4 expert matmul dispatcher: y = x W^T (+ b) with W as canonical MXFP4 bytes.

- CUDA tensors with Triton: `triton.mxfp4_grouped` (decode in registers, fp32 `tl.dot`).
- CPU with the C++ kernel (cpu.py): N <= GEMV_MAX_TOKENS tokens stream the codes once through
  `cpu.gemv`; more tokens dequantise with `cpu.dequantize` and run one fp32 sgemm (F.linear),
  where the matmul, not the bytes, is the cost.
- otherwise the reference (reference.py).
Every path accumulates in fp32 and returns x's dtype (bf16/fp16 inputs are computed in fp32 and
rounded once at the end). The path depends only on the device, dtype and N, so the same call
(paged or resident weights) always gives the same bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from localmoe.kernels._triton import usable
from localmoe.kernels.mxfp4_moe import cpu
from localmoe.kernels.mxfp4_moe.reference import naive_mxfp4_grouped, naive_mxfp4_linear

GEMV_MAX_TOKENS = 96  # measured: GEMV at 0.6x the time of dequantise + sgemm for 64 tokens, 1.0x at 128


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] -> [N, O] in x's dtype; packed U8 [O, K/2], scales U8 [O, K/32], bias [O] or None."""
    if usable(x):
        from localmoe.kernels.mxfp4_moe import triton as tk

        return tk.mxfp4_linear(x, packed, scales, bias)
    if x.device.type == "cpu" and packed.device.type == "cpu" and cpu.library() is not None:
        xf = x.float()
        if x.shape[0] <= GEMV_MAX_TOKENS:
            y = cpu.gemv(xf, packed, scales)
            if bias is not None:
                y += bias.float()
        else:
            y = F.linear(xf, cpu.dequantize(packed, scales), None if bias is None else bias.float())
        return y.to(x.dtype)
    return naive_mxfp4_linear(x, packed, scales, bias)


def mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """Row m of x [M, K] through expert ids[m] of stacked packed [E, O, K/2], scales [E, O, K/32]."""
    if usable(x):
        from localmoe.kernels.mxfp4_moe import triton as tk

        return tk.mxfp4_grouped(x, packed, scales, ids, bias)
    return naive_mxfp4_grouped(x, packed, scales, ids, bias)


__all__ = ["GEMV_MAX_TOKENS", "mxfp4_grouped", "mxfp4_linear", "naive_mxfp4_grouped", "naive_mxfp4_linear"]
