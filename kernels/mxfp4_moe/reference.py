"""MXFP4 expert matmul, the spec in plain PyTorch (float32 accumulate).

Weights are canonical MXFP4 (store/mxfp4.py): packed U8 [O, K/2], element 2i in the low nibble
of byte i; scales U8 [O, K/32], E8M0 with bias 127.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.store.mxfp4 import dequantize


def naive_mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [N, K] -> x W^T + b: [N, O] in x's dtype; W dequantised to fp32, fp32 matmul."""
    y = F.linear(x.float(), dequantize(packed, scales, torch.float32), None if bias is None else bias.float())
    return y.to(x.dtype)


def naive_mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                        bias: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped expert matmul: row m of x through expert ids[m].

    x: [M, K]; packed: [E, O, K/2]; scales: [E, O, K/32]; ids: [M] int; bias: [E, O] or None.
    Returns [M, O] in x's dtype (fp32 accumulate).
    """
    out = x.new_empty(x.shape[0], packed.shape[1], dtype=torch.float32)
    for e in ids.unique().tolist():
        rows = (ids == e).nonzero().squeeze(1)
        out[rows] = naive_mxfp4_linear(x[rows].float(), packed[e], scales[e], None if bias is None else bias[e])
    return out.to(x.dtype)
