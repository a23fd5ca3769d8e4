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


def dense_layer(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, addresses: torch.Tensor,
                experts: torch.Tensor, dtype: torch.dtype, intermediate: int, kind: str, params: tuple[float, float],
                out: torch.Tensor) -> torch.Tensor:
    """`dense_expert` for each expert of `experts` (int64, increasing ids) over the tokens of x [T, D] that chose it
    (ids [T, k] int64, weights [T, k] fp32), in one kernel call: the same bits as one `dense_expert` call per
    expert in that order. addresses: int64 [E, 3] of each expert's gate, up, down (all `dtype`, contiguous, held
    by the caller while the call runs)."""
    T, D = x.shape
    assert x.dtype == out.dtype == weights.dtype == torch.float32 and out.shape == x.shape, "x, out: fp32 [T, D]"
    assert ids.dtype == experts.dtype == addresses.dtype == torch.int64 and weights.shape == ids.shape \
        and ids.shape[0] == T, "ids int64 [T, k], weights fp32 [T, k], experts and addresses int64"
    assert addresses.dim() == 2 and addresses.shape[1] == 3 and dtype in DTYPES, "addresses [E, 3], fp32 or bf16"
    tensors = (x, ids, weights, addresses, experts, out)
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in tensors), "contiguous CPU tensors"
    if experts.numel() == 0 or T == 0:
        return out
    lib = library()
    scratch = torch.empty(lib.dense_moe_layer_scratch(T, D, intermediate), dtype=torch.float32)
    lib.dense_moe_layer(x.data_ptr(), D, ids.data_ptr(), weights.data_ptr(), T, ids.shape[1], addresses.data_ptr(),
                        experts.data_ptr(), experts.numel(), DTYPES[dtype], intermediate, GLU_KINDS.index(kind),
                        *params, out.data_ptr(), scratch.data_ptr(), threads())
    return out
