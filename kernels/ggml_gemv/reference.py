"""GEMV from GGUF block formats, the spec in plain PyTorch: W dequantised exactly
(quant/ggml.py), x rounded to int8 as the kernel does (kernels/mxfp4_moe reference.q8_round: llama.cpp's
activations, per 32 values (Q8_0) and per 256 for the K-quants (Q8_K): `x_block`), one matmul in x's dtype."""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType
from localmoe.kernels.ggml_gemv.repacked import plain_type, unpack
from localmoe.kernels.mxfp4_moe.reference import q8_round

from localmoe.quant.ggml import dequantize

K_QUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)  # super-blocks of 256
SUPER_BLOCK_TYPES = (*K_QUANTS, GGMLQuantizationType.IQ4_XS)  # the kernels' types whose rows are whole 256s


def x_block(ggml_type) -> int:
    """Values per int8 step of x for rows of `ggml_type`: 256 for the K-quants (Q8_K; repacked ones too), else 32
    (Q8_0)."""
    return 256 if plain_type(ggml_type) in K_QUANTS else 32


def row_values(ggml_type) -> int:
    """Values per block of a row of `ggml_type` the kernels read: 256 for the K-quants and IQ4_XS (whose x is still
    rounded per 32: `x_block`), else 32."""
    return 256 if plain_type(ggml_type) in SUPER_BLOCK_TYPES else 32


def q16_round(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) rounded to int16 per 32 values, as the x16 rows read it: q = round(x * 32767 /
    amax) to nearest even with 32767 / amax in fp32 and the product rounded to fp32 first, then q * (amax / 32767)
    (fp32 step); an all-zero block stays zero."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True).float()
    inv = torch.where(amax > 0, 32767.0 / amax, torch.zeros_like(amax))
    q = torch.round(blocks.float() * inv)
    return (q.to(x.dtype) * (amax / 32767.0).to(x.dtype)).reshape(x.shape)


def naive_ggml_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type, shape: tuple[int, int],
                    bias: torch.Tensor | None = None, exact_x: bool = False, x16: bool = False) -> torch.Tensor:
    """x [N, K] -> y [N, O] = q8_round(x, x_block(ggml_type)) W^T (+ bias), W the raw blocks [O, row bytes] of
    `ggml_type` (a repacked type: its GGUF layout, repacked.unpack); exact_x: x as it is; x16: q16_round(x) instead."""
    w = dequantize(unpack(raw, ggml_type, shape[0]), plain_type(ggml_type), shape, torch.float32).to(x.dtype)
    y = (x if exact_x else q16_round(x) if x16 else q8_round(x, x_block(ggml_type))) @ w.T
    return y if bias is None else y + bias.to(x.dtype)
