"""FP8 (e4m3) cache block quantise/dequantise in Triton: one program per BLOCK_N rows, the
whole row (D <= BLOCK_D, a power of two) in registers, so amax and the cast are one pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _round_e4m3(y):
    """fp32 y (|y| <= 448) rounded to nearest even on the e4m3 grid, still fp32. Done by hand so
    the cast that follows is exact: Triton's interpreter rounds some values to the wrong binade."""
    e = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # binade of y (denormals: -127)
    step = tl.exp2((tl.maximum(e, -6) - 3).to(tl.float32))  # 3 mantissa bits; subnormal spacing 2^-9
    r = y / step  # exact (a power of two); |r| < 16
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2^23: round half to even in fp32
    return r * step


@triton.jit
def _quantize_kernel(x_ptr, q_ptr, s_ptr, N, D, stride_x, stride_q, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < N)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    q = _round_e4m3(x / scale[:, None]).to(q_ptr.dtype.element_ty)  # exact after rounding
    tl.store(q_ptr + rows[:, None] * stride_q + cols[None, :], q, mask=m)
    tl.store(s_ptr + rows, scale, mask=rows < N)


@triton.jit
def _dequantize_kernel(q_ptr, s_ptr, y_ptr, N, D, stride_q, stride_y, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_D)
    m = (rows < N)[:, None] & (cols < D)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_q + cols[None, :], mask=m, other=0.0).to(tl.float32)
    s = tl.load(s_ptr + rows, mask=rows < N, other=1.0)
    tl.store(y_ptr + rows[:, None] * stride_y + cols[None, :], (q * s[:, None]).to(y_ptr.dtype.element_ty), mask=m)


def quantize_fp8(x: torch.Tensor, block_n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] (fp32/fp16/bf16, rows contiguous) -> (float8_e4m3fn [N, D], fp32 scale [N])."""
    assert x.dim() == 2 and x.stride(1) == 1, "x: [N, D] with contiguous rows"
    N, D = x.shape
    q = torch.empty(N, D, dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty(N, dtype=torch.float32, device=x.device)
    _quantize_kernel[(triton.cdiv(N, block_n),)](x, q, s, N, D, x.stride(0), q.stride(0), BLOCK_N=block_n,
                                                 BLOCK_D=triton.next_power_of_2(D))
    return q, s


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32,
                   block_n: int = 16) -> torch.Tensor:
    """(float8_e4m3fn [N, D], scale [N]) -> [N, D] of dtype."""
    assert q.dim() == 2 and q.stride(1) == 1 and scale.shape == q.shape[:1] and q.dtype == torch.float8_e4m3fn
    N, D = q.shape
    y = torch.empty(N, D, dtype=dtype, device=q.device)
    _dequantize_kernel[(triton.cdiv(N, block_n),)](q, scale.float().contiguous(), y, N, D, q.stride(0), y.stride(0),
                                                   BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(D))
    return y
