"""Block-scaled FP8 weights (DeepSeek V3's `weight_scale_inv`): one float scale per (bo x bi) block."""

from __future__ import annotations

import math

import torch

from localmoe.errors import CheckpointError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEFAULT_BLOCK = (128, 128)  # quantization_config.weight_block_size when the config does not say


def dequantize_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK) -> torch.Tensor:
    """FP8 `w` [rows, cols] with `scale_inv` [ceil(rows / bo), ceil(cols / bi)] -> float32 [rows, cols]."""
    bo, bi = block
    rows, cols = w.shape
    if w.dtype not in FP8_DTYPES or tuple(scale_inv.shape) != (math.ceil(rows / bo), math.ceil(cols / bi)):
        raise CheckpointError(f"weight {w.dtype} {list(w.shape)} with weight_scale_inv {list(scale_inv.shape)} "
                              f"is not FP8 with {bo}x{bi} block scales")
    s = scale_inv.float().repeat_interleave(bo, 0)[:rows].repeat_interleave(bi, 1)[:, :cols]
    return w.float() * s
