"""The CPU fast path: `dense_moe_cpu.cpp` (AVX2 + FMA) in the localmoe CPU library (kernels/_cpu)."""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.mxfp4_moe import GLU_KINDS

DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def dense_expert(x: torch.Tensor, rows: torch.Tensor, weights: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                 down: torch.Tensor, kind: str, params: tuple[float, float], out: torch.Tensor) -> torch.Tensor:
    """reference.naive_dense_expert in one kernel call: every CPU tensor contiguous, x / weights / out fp32,
    rows int64, gate / up / down all fp32 or all bf16."""
    D = x.shape[1]
    N, I = rows.shape[0], gate.shape[0]
    assert x.dim() == 2 and x.dtype == out.dtype == weights.dtype == torch.float32 and out.shape == x.shape, \
        "x, out: fp32 [T, D]"
    assert rows.dtype == torch.int64 and weights.shape == rows.shape == (N,), "rows int64 [N], weights fp32 [N]"
    assert gate.dtype == up.dtype == down.dtype and gate.dtype in DTYPES, "gate, up, down: one of fp32, bf16"
    assert gate.shape == up.shape == (I, D) and down.shape == (D, I), f"gate/up [I, {D}], down [{D}, I]"
    tensors = (x, rows, weights, gate, up, down, out)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), "contiguous CPU tensors"
    if N == 0:
        return out
    lib = library()
    scratch = torch.empty(lib.dense_moe_scratch(N, D, I), dtype=torch.float32)
    lib.dense_moe_expert(x.data_ptr(), D, rows.data_ptr(), weights.data_ptr(), N, gate.data_ptr(), up.data_ptr(),
                         down.data_ptr(), DTYPES[gate.dtype], I, GLU_KINDS.index(kind), *params, out.data_ptr(),
                         scratch.data_ptr(), threads())
    return out
