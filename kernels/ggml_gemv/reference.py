"""GEMV from GGUF block formats, the spec in plain PyTorch: W dequantised exactly
(quant/ggml.py), x rounded to int8 per 32 values as the kernel does
(kernels/mxfp4_moe reference.q8_round: llama.cpp's Q8 activations), one matmul in x's dtype."""

from __future__ import annotations

import torch
from localmoe.kernels.mxfp4_moe.reference import q8_round

from localmoe.quant.ggml import dequantize


def naive_ggml_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type, shape: tuple[int, int],
                    bias: torch.Tensor | None = None, exact_x: bool = False) -> torch.Tensor:
    """x [N, K] -> y [N, O] = q8_round(x) W^T (+ bias), W the raw blocks [O, row bytes] of `ggml_type`;
    exact_x: x as it is."""
    w = dequantize(raw, ggml_type, shape, torch.float32).to(x.dtype)
    y = (x if exact_x else q8_round(x)) @ w.T
    return y if bias is None else y + bias.to(x.dtype)
