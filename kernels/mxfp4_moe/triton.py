"""Grouped MXFP4 expert matmul in Triton, straight from blocks and scales.

Rows are sorted by expert on the host and cut into tiles of BLOCK_M rows of ONE expert; each
program computes one tile against BLOCK_O output rows of that expert's weight, decoding the
codes of a [BLOCK_O, BLOCK_K] slice in registers (e2m1 by arithmetic, scale 2^(s - 127)) and
accumulating in fp32 with `tl.dot`. Decode (1 row per expert) and prefill use the same kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e2m1(code):
    """uint8/int32 codes (low 4 bits) -> fp32 values."""
    mag = code & 7
    e = mag >> 1
    m = (mag & 1).to(tl.float32)
    v = tl.where(e == 0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2((e - 1).to(tl.float32)))
    return tl.where((code & 8) != 0, -v, v)


@triton.jit
def _grouped_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, rows_ptr, tile_expert_ptr, tile_start_ptr, tile_end_ptr,
                    O, K, stride_xm, stride_pe, stride_po, stride_se, stride_so, stride_ym,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_o = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    offs_m = start + tl.arange(0, BLOCK_M)
    mask_m = offs_m < end
    rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)  # original row of each sorted slot
    offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < O
    half = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kb = k0 // 2 + half  # byte index
        mask_k = kb < K // 2
        codes = tl.load(p_ptr + e * stride_pe + offs_o[:, None] * stride_po + kb[None, :],
                        mask=mask_o[:, None] & mask_k[None, :], other=0).to(tl.int32)  # [BO, BK/2]
        sb = tl.load(s_ptr + e * stride_se + offs_o[:, None] * stride_so + (kb // 16)[None, :],
                     mask=mask_o[:, None] & mask_k[None, :], other=127).to(tl.int32)  # scale of each byte
        scale = tl.where(sb == 255, float("nan"), tl.exp2((tl.minimum(sb, 254) - 127).to(tl.float32)))
        lo = _e2m1(codes) * scale
        hi = _e2m1(codes >> 4) * scale
        w = tl.reshape(tl.join(lo, hi), (BLOCK_O, BLOCK_K))  # element 2i = low nibble of byte i
        offs_k = k0 + tl.arange(0, BLOCK_K)
        xt = tl.load(x_ptr + rows[:, None] * stride_xm + offs_k[None, :],
                     mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32)
        acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * O + offs_o, mask=mask_o, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + offs_o[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_o[None, :])


def _tiles(ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, ...]:
    """Sorted row order and (expert, start, end) of each tile of at most block_m rows of one expert."""
    order = ids.argsort(stable=True)
    counts = torch.bincount(ids, minlength=1).tolist()
    experts, starts, ends, pos = [], [], [], 0
    for e, n in enumerate(counts):
        for s in range(pos, pos + n, block_m):
            experts.append(e), starts.append(s), ends.append(min(s + block_m, pos + n))
        pos += n
    dev = ids.device
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)
    return order.to(torch.int32), as_t(experts), as_t(starts), as_t(ends)


def mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None = None, block_m: int = 16, block_o: int = 64,
                  block_k: int = 64) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16), packed [E, O, K/2], scales [E, O, K/32] uint8, ids [M] -> [M, O] in x's dtype."""
    M, K = x.shape
    E, O, half = packed.shape
    assert half * 2 == K and K % 32 == 0, "packed [E, O, K/2] with K % 32 == 0"
    assert tuple(scales.shape) == (E, O, K // 32), "scales [E, O, K/32]"
    assert packed.dtype == scales.dtype == torch.uint8 and ids.shape == (M,)
    assert x.stride(1) == 1 and packed.stride(2) == 1 and scales.stride(2) == 1, "inner dims must be contiguous"
    assert block_k % 32 == 0
    y = x.new_empty(M, O)
    if M == 0:
        return y
    rows, tile_e, tile_s, tile_end = _tiles(ids.long(), block_m)
    b = bias.contiguous() if bias is not None else y
    grid = (tile_e.numel(), triton.cdiv(O, block_o))
    _grouped_kernel[grid](x, packed, scales, b, y, rows, tile_e, tile_s, tile_end, O, K, x.stride(0),
                          packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1), y.stride(0),
                          HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_O=block_o, BLOCK_K=block_k)
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: x [N, K] -> [N, O]."""
    ids = torch.zeros(x.shape[0], dtype=torch.long, device=x.device)
    return mxfp4_grouped(x, packed[None], scales[None], ids, None if bias is None else bias[None])
