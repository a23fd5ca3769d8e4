"""Residual add + RMSNorm, the spec in plain PyTorch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] += delta (in place, when given); returns rms_norm(x) * weight [..., D] (fp32)."""
    if delta is not None:
        x.add_(delta)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)
