"""FP8 (e4m3) cache blocks with one fp32 scale per block, the spec in plain PyTorch.

A block is one row of D values (one token and head of a K/V or latent cache, as
engine/cache.py stores them). scale = amax / 448 maps the block's largest magnitude onto
e4m3's largest finite value (nothing saturates); an all-zero block gets scale 1. Values round
to nearest even on the e4m3 grid.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def naive_quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] float -> (q float8_e4m3fn [N, D], scale fp32 [N])."""
    amax = x.float().abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def naive_dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(q [N, D] float8_e4m3fn, scale [N]) -> [N, D] of dtype (computed in fp32)."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
