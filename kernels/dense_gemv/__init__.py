"""Dense GEMV dispatcher for decode: y = x W^T (+ b), W fp32 or bf16, x fp32, fp32 accumulation.

- CPU tensors (contiguous, fp32 x and bias, fp32/bf16 W) with the CPU library (kernels/_cpu):
  `cpu.gemv`: one or two tokens stream each weight row once (at memory bandwidth); three or more run register
  tiles of tokens x outputs (dense_tiles.h: at or above torch's sgemm speed, prompt chunks in token blocks that
  stay in L2), every token with the bits it has alone.
- otherwise the reference (reference.py).
The engine's `Linear` takes the kernel for every fp32 CPU input, decode and prefill, for its row-independent bits
(and, on bf16 weights, no widened copy).
"""

from __future__ import annotations

import functools

import torch
from localmoe.kernels._cpu import library
from localmoe.kernels.dense_gemv import cpu
from localmoe.kernels.dense_gemv.reference import naive_dense_gemv


def kernel_available() -> bool:
    """Whether the CPU kernel is usable in this process (the library built and loaded)."""
    return library() is not None


GEMV_MAX_ROWS = 8  # rows every matrix of the engine computes each on its own (engine/batch.py), kernel or not


def _takes_weight(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether the CPU kernel can read this weight and bias (contiguous on the CPU, fp32/bf16 weight,
    fp32 bias) and the library is built."""
    tensors = (weight,) if bias is None else (weight, bias)
    return (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors) and weight.dtype in cpu.DTYPES
            and (bias is None or bias.dtype == torch.float32) and library() is not None)


def _fast(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (x.device.type == "cpu" and x.is_contiguous() and x.dtype == torch.float32 and x.dim() == 2
            and _takes_weight(weight, bias))


def kernel_for(weight: torch.Tensor, bias: torch.Tensor | None = None):
    """For a layer that calls the GEMV with the same weight many times: `fn(x [N, K] fp32 contiguous)
    -> y [N, O]` running the CPU kernel with only x left to check, or None where the kernel cannot
    take this weight and bias (then use `dense_gemv`). The shapes `cpu.gemv` asserts per call are
    checked here, once."""
    shapes = weight.dim() == 2 and (bias is None or tuple(bias.shape) == (weight.shape[0],))
    if not shapes or not _takes_weight(weight, bias):
        return None
    return functools.partial(cpu.gemv_prepared, weight=weight, bias=bias, entry=cpu.DTYPES[weight.dtype])


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] fp32, weight [O, K] fp32/bf16, bias [O] or None -> y [N, O] fp32."""
    if _fast(x, weight, bias):
        return cpu.gemv(x, weight, bias)
    return naive_dense_gemv(x, weight, bias)


__all__ = ["dense_gemv", "kernel_available", "kernel_for", "naive_dense_gemv"]
