"""One routed expert with dense matrices over its tokens, the spec in plain PyTorch."""

from __future__ import annotations

import torch
from localmoe.kernels.mxfp4_moe.reference import glu


def naive_dense_expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor, down: torch.Tensor, kind: str, params: tuple[float, float],
                       out: torch.Tensor) -> torch.Tensor:
    """out[rows[n]] += weights[n] * down(glu(gate x[rows[n]], up x[rows[n]])), in place; returns out.

    x, out: [T, D] fp32; rows: [N] int64 (distinct); weights: [N] fp32; gate, up: [I, D] and down: [D, I],
    fp32 or bf16 (used at their exact values); kind, params: kernels/mxfp4_moe reference.glu.
    """
    xs = x.index_select(0, rows)
    h = glu(kind, xs @ gate.float().T, xs @ up.float().T, *params)
    return out.index_add_(0, rows, (h @ down.float().T) * weights[:, None])
