"""Dense GEMV, the spec in plain PyTorch."""

from __future__ import annotations

import torch


def naive_dense_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T (+ b), fp32 accumulation.

    x: [N, K] fp32; weight: [O, K] fp32 or bf16 (used at its exact value); bias: [O] fp32 or None.
    Returns y: [N, O] fp32.
    """
    y = x.float() @ weight.float().T
    return y if bias is None else y + bias.float()
