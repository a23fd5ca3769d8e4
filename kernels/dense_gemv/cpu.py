"""The CPU fast path: `dense_cpu.cpp` (AVX2 + FMA) in the localmoe CPU library (kernels/_cpu).

torch's one-row F.linear reached 11 GB/s for fp32 and 5.6 GB/s for bf16 weights on one Zen 4
core, where a plain sum streams 20 GB/s, and did not scale to 2 threads; this kernel streams
each weight row once for all N tokens, widening bf16 to fp32 in registers.
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads

DTYPES = {torch.float32: "dense_gemv_f32", torch.bfloat16: "dense_gemv_bf16"}


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, K] fp32, weight [O, K] fp32/bf16, bias [O] fp32 or None (all contiguous, CPU) -> [N, O] fp32;
    the same bits for a token whatever N and the thread count."""
    assert x.dtype == torch.float32 and x.dim() == 2 and x.is_contiguous() and x.device.type == "cpu", "x: fp32 [N, K]"
    assert weight.dtype in DTYPES and weight.dim() == 2 and weight.is_contiguous() and weight.device.type == "cpu"
    N, K = x.shape
    O = weight.shape[0]
    assert weight.shape[1] == K, f"weight {tuple(weight.shape)} against x [{N}, {K}]"
    if bias is not None:
        assert bias.dtype == torch.float32 and tuple(bias.shape) == (O,) and bias.is_contiguous(), "bias: fp32 [O]"
    return gemv_prepared(x, weight, bias, DTYPES[weight.dtype])


def gemv_prepared(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, entry: str) -> torch.Tensor:
    """`gemv` without the checks, for a weight and bias checked once (dense_gemv.kernel_for): a decode
    step makes a few dozen of these calls, and each checked line costs more than the kernel's launch."""
    N, O = x.shape[0], weight.shape[0]
    y = x.new_empty(N, O)
    getattr(library(), entry)(x.data_ptr(), N, x.shape[1], weight.data_ptr(), O,
                              None if bias is None else bias.data_ptr(), y.data_ptr(), threads())
    return y


READ_CHUNK = 16384  # floats (64 KiB) per chunk of work in `read_sums`


def read_sums(x: torch.Tensor) -> torch.Tensor:
    """The sums of x's 64 KiB chunks (x fp32 contiguous, a multiple of READ_CHUNK values): a plain read of x at
    the memory's speed, on `threads()` threads (the roofline a weight stream is measured against)."""
    assert x.dtype == torch.float32 and x.is_contiguous() and x.numel() % READ_CHUNK == 0, "x: fp32, 64 KiB chunks"
    partial = x.new_empty(x.numel() // READ_CHUNK)
    library().dense_read(x.data_ptr(), x.numel(), READ_CHUNK, partial.data_ptr(), threads())
    return partial
