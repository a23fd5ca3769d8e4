"""GEMV from GGUF block formats, the spec in plain PyTorch: W dequantised exactly
(quant/ggml.py), x rounded to int8 as the kernel does (kernels/mxfp4_moe reference.q8_round: llama.cpp's
activations, per 32 values (Q8_0) and per 256 for the K-quants (Q8_K): `x_block`), one matmul in x's dtype."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from localmoe.kernels.mxfp4_moe.reference import q8_round

from localmoe.quant.ggml import dequantize

K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)  # super-blocks of 256


def x_block(ggml_type) -> int:
    """Values per int8 step of x for rows of `ggml_type`: 256 for the K-quants (Q8_K), else 32 (Q8_0)."""
    return 256 if ggml_type in K_QUANTS else 32


def naive_ggml_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type, shape: tuple[int, int],
                    bias: torch.Tensor | None = None, exact_x: bool = False) -> torch.Tensor:
    """x [N, K] -> y [N, O] = q8_round(x, x_block(ggml_type)) W^T (+ bias), W the raw blocks [O, row bytes] of
    `ggml_type`; exact_x: x as it is."""
    w = dequantize(raw, ggml_type, shape, torch.float32).to(x.dtype)
    y = (x if exact_x else q8_round(x, x_block(ggml_type))) @ w.T
    return y if bias is None else y + bias.to(x.dtype)
