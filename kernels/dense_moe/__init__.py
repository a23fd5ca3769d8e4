"""Routed experts with dense (fp32 / bf16) matrices over a chunk's tokens: one call per expert.

`dense_expert(x, rows, weights, gate, up, down, kind, params, out)`: out[rows[n]] += weights[n] *
down(glu(gate x[rows[n]], up x[rows[n]])). CPU tensors the kernel takes (`takes`) with the CPU library
(kernels/_cpu) run `cpu.dense_expert`, each weight row read once for all of the expert's tokens;
otherwise the reference (reference.py).
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library
from localmoe.kernels.dense_moe import cpu
from localmoe.kernels.dense_moe.reference import naive_dense_expert


def takes(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether the CPU kernel computes this expert on x (else the reference runs)."""
    mats = (gate, up, down)
    return (x.device.type == "cpu" and x.dtype == torch.float32 and x.is_contiguous()
            and all(m.device.type == "cpu" and m.dtype == gate.dtype and m.is_contiguous() for m in mats)
            and gate.dtype in cpu.DTYPES and library() is not None)


def dense_expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, kind: str, params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """x, out [T, D] fp32; rows [N] int64 (distinct), weights [N] fp32; gate, up [I, D], down [D, I] fp32 or bf16;
    out += the routed expert's weighted output on its rows, in place; returns out."""
    if takes(x, gate, up, down) and out.is_contiguous():
        return cpu.dense_expert(x, rows.contiguous(), weights.float().contiguous(), gate, up, down, kind, params,
                                out)
    return naive_dense_expert(x, rows, weights, gate, up, down, kind, params, out)


__all__ = ["dense_expert", "naive_dense_expert", "takes"]
