"""Grouped MXFP4 expert matmul in Triton, straight from blocks and scales: a GEMV for decode, `tl.dot` tiles
for prefill, chosen by shape only.

Rows are grouped by expert on the device (triton_tiles.py: no host sync, no host-to-device copy, a grid
known from shapes, so a call can be captured in a CUDA graph); each program takes one tile of at most
BLOCK_N rows of ONE expert and BLOCK_O output rows of that expert's weight.

- GEMV (at most GEMV_MAX_ROWS rows per expert on average): each program streams BLOCK_O whole rows of
  packed bytes, BLOCK_K / 2 contiguous bytes per row at a time, decodes both nibbles of each byte in
  registers and reduces with `tl.sum` (no `tl.dot` at these N): per 32-value block the products are
  summed, then multiplied by the block's scale. Where rows are few (one token, few experts) K is split
  over SPLIT_K programs writing fp32 partials that one sum adds (deterministic, no atomics).
- `tl.dot` (prefill): the codes of a [BLOCK_O, BLOCK_K] slice are decoded and scaled into fp32 registers
  and multiplied by a tile of BLOCK_M rows with `tl.dot`: on tensor cores in bf16 for bf16 x (both
  operands exact in bf16), in fp32 ("ieee") for fp32 / fp16 x.

Decoding e2m1 (s e1 e0 m): the 3 magnitude bits shifted into an fp16's exponent and mantissa are the
value times 2^-14 (e = 0, m = 1 lands on fp16's subnormal 2^-15 = 0.5 * 2^-14), the sign bit goes to
bit 15; x is multiplied by 2^14 once per slice instead. Scales E8M0 are built from their bits (2^(s-127),
0xFF = NaN), so the result is exact before the fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localmoe.kernels.mxfp4_moe.triton_tiles import _launch, max_tiles, plan

GEMV_MAX_ROWS = 16  # average rows per expert up to which the GEMV runs; above, tl.dot tiles
SPLIT_K_TARGET = 1024  # programs wanted in flight before K is split (an H200 has 132 SMs)
MAX_SPLIT_K = 8


@triton.jit
def _e2m1_x16k(code):
    """Codes in the low 4 bits of int32 -> fp32 values times 2^-14 (exact: fp16 bits, subnormal for 0.5)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scale(sb):
    """E8M0 bytes (int32) -> fp32 2^(s - 127) from the bits: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    bits = tl.where(sb == 0, 0x400000, tl.where(sb == 255, 0x7FC00000, sb << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, rows_ptr, sorted_ptr, tile_start_ptr, tile_expert_ptr,
                 M, O, K, stride_xm, stride_pe, stride_po, stride_se, stride_so, stride_ys, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr):
    tile = tl.program_id(0)
    pid_o = tl.program_id(1)
    pid_k = tl.program_id(2)
    start = tl.load(tile_start_ptr + tile)
    if start < M:  # tiles past the real count (the grid is an upper bound) do nothing
        e = tl.load(tile_expert_ptr + tile)
        offs_n = start + tl.arange(0, BLOCK_N)
        mask_n = offs_n < M
        mask_n = mask_n & (tl.load(sorted_ptr + offs_n, mask=mask_n, other=-1) == e)
        rows = tl.load(rows_ptr + offs_n, mask=mask_n, other=0)
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_o = offs_o < O
        blk = tl.arange(0, BLOCK_K // 32)
        byte = blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]: 16 bytes per 32-value block
        w_rows = p_ptr + e.to(tl.int64) * stride_pe + offs_o[:, None, None] * stride_po  # [BO, 1, 1]
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_o[:, None] * stride_so  # [BO, 1]
        x_rows = x_ptr + rows[:, None, None].to(tl.int64) * stride_xm  # [BN, 1, 1]
        w_mask, x_mask = mask_o[:, None, None], mask_n[:, None, None]
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        acc = tl.zeros((BLOCK_N, BLOCK_O, BLOCK_K // 32), dtype=tl.float32)  # per block, scaled
        for k0 in range(k_lo, k_hi, BLOCK_K):
            kb = tl.multiple_of(k0 // 2, 16) + byte
            mk = kb < K // 2
            codes = tl.load(w_rows + kb, mask=w_mask & mk, other=0).to(tl.int32)  # [BO, NB, 16]
            lo = _e2m1_x16k(codes)  # element 2i of byte i
            hi = _e2m1_x16k(codes >> 4)  # element 2i + 1
            xe = tl.load(x_rows + 2 * kb, mask=x_mask & mk, other=0.0).to(tl.float32) * 16384.0  # [BN, NB, 16]
            xo = tl.load(x_rows + 2 * kb + 1, mask=x_mask & mk, other=0.0).to(tl.float32) * 16384.0
            part = tl.sum(lo[None, :, :, :] * xe[:, None, :, :] + hi[None, :, :, :] * xo[:, None, :, :], axis=3)
            kblk = k0 // 32 + blk
            sb = tl.load(s_rows + kblk[None, :], mask=mask_o[:, None] & (kblk < K // 32)[None, :], other=127)
            acc += part * _scale(sb.to(tl.int32))[None, :, :]  # [BN, BO, NB]
        acc = tl.sum(acc, axis=2)
        if HAS_BIAS:
            bias = tl.load(b_ptr + e.to(tl.int64) * O + offs_o, mask=mask_o & (offs_o * 0 + pid_k == 0), other=0.0)
            acc += bias.to(tl.float32)[None, :]
        tl.store(y_ptr + pid_k * stride_ys + rows[:, None].to(tl.int64) * stride_ym + offs_o[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_o[None, :])


@triton.jit
def _dot_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, rows_ptr, sorted_ptr, tile_start_ptr, tile_expert_ptr,
                M, O, K, stride_xm, stride_pe, stride_po, stride_se, stride_so, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                BF16: tl.constexpr):
    tile = tl.program_id(0)
    pid_o = tl.program_id(1)
    start = tl.load(tile_start_ptr + tile)
    if start < M:
        e = tl.load(tile_expert_ptr + tile)
        offs_m = start + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        mask_m = mask_m & (tl.load(sorted_ptr + offs_m, mask=mask_m, other=-1) == e)
        rows = tl.load(rows_ptr + offs_m, mask=mask_m, other=0)  # original row of each sorted slot
        offs_o = pid_o * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_o = offs_o < O
        half = tl.arange(0, BLOCK_K // 2)
        w_rows = p_ptr + e.to(tl.int64) * stride_pe + offs_o[:, None] * stride_po
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_o[:, None] * stride_so
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = k0 // 2 + half  # byte index
            mask_w = mask_o[:, None] & (kb < K // 2)[None, :]
            codes = tl.load(w_rows + kb[None, :], mask=mask_w, other=0).to(tl.int32)  # [BO, BK/2]
            scale = _scale(tl.load(s_rows + (kb // 16)[None, :], mask=mask_w, other=127).to(tl.int32))
            lo = _e2m1_x16k(codes) * scale
            hi = _e2m1_x16k(codes >> 4) * scale
            w = tl.reshape(tl.join(lo, hi), (BLOCK_O, BLOCK_K))  # element 2i = low nibble of byte i
            offs_k = k0 + tl.arange(0, BLOCK_K)
            xt = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                         mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0).to(tl.float32) * 16384.0
            if BF16:  # both operands exact in bf16 (w is e2m1 x 2^(s - 141)): tensor cores, fp32 accumulate
                acc += tl.dot(xt.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            else:
                acc += tl.dot(xt, tl.trans(w), input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(b_ptr + e.to(tl.int64) * O + offs_o, mask=mask_o, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * stride_ym + offs_o[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_o[None, :])


def gemv_config(M: int, E: int, O: int, K: int) -> dict | None:
    """Tile sizes of the GEMV for M rows over E experts (shapes only), or None where `tl.dot` tiles are used."""
    per_expert = triton.cdiv(M, min(E, M))
    if per_expert > GEMV_MAX_ROWS:
        return None
    block_n = triton.next_power_of_2(per_expert)
    block_o, block_k = {1: (32, 256), 2: (16, 256), 4: (16, 128), 8: (8, 128), 16: (8, 64)}[block_n]
    block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    programs = max_tiles(M, E, block_n) * triton.cdiv(O, block_o)
    split = 1
    while split < MAX_SPLIT_K and programs * split < SPLIT_K_TARGET and triton.cdiv(K, block_k) >= 4 * split:
        split *= 2
    return {"BLOCK_N": block_n, "BLOCK_O": block_o, "BLOCK_K": block_k, "SPLIT_K": split}


def mxfp4_grouped(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, ids: torch.Tensor,
                  bias: torch.Tensor | None = None, config: dict | str | None = None) -> torch.Tensor:
    """x [M, K] (fp32/fp16/bf16), packed [E, O, K/2], scales [E, O, K/32] uint8, ids [M] int (in [0, E)),
    bias [E, O] or None -> [M, O] in x's dtype (fp32 accumulate). `config` overrides `gemv_config`'s
    GEMV tile sizes, or "dot" forces `tl.dot` tiles (benchmarks)."""
    M, K = x.shape
    E, O, half = packed.shape
    assert half * 2 == K and K % 32 == 0, "packed [E, O, K/2] with K % 32 == 0"
    assert tuple(scales.shape) == (E, O, K // 32), "scales [E, O, K/32]"
    assert packed.dtype == scales.dtype == torch.uint8 and tuple(ids.shape) == (M,)
    assert x.stride(1) == 1 and packed.stride(2) == 1 and scales.stride(2) == 1, "inner dims must be contiguous"
    assert bias is None or tuple(bias.shape) == (E, O), "bias [E, O]"
    y = x.new_empty(M, O)
    if M == 0:
        return y
    b = None if bias is None else bias.contiguous()
    cfg = None if config == "dot" else config or gemv_config(M, E, O, K)
    if cfg is None:
        block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(M, min(E, M)))))
        rows, sorted_ids, tile_start, tile_expert = plan(ids, E, block_m)
        _launch(_dot_kernel, (tile_start.numel(), triton.cdiv(O, 64)), x, packed, scales, y if b is None else b, y,
                rows, sorted_ids, tile_start, tile_expert, M, O, K, x.stride(0), packed.stride(0), packed.stride(1),
                scales.stride(0), scales.stride(1), y.stride(0), HAS_BIAS=b is not None, BLOCK_M=block_m,
                BLOCK_O=64, BLOCK_K=64, BF16=x.dtype == torch.bfloat16)
        return y
    return gemv(x, packed, scales, b, plan(ids, E, cfg["BLOCK_N"]), cfg, y)


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
         tables: tuple[torch.Tensor, ...], cfg: dict, y: torch.Tensor) -> torch.Tensor:
    """The GEMV kernel (and its split-K sum) into y [M, O] over tile tables built for cfg["BLOCK_N"]:
    `mxfp4_grouped` without the checks and the tables (benchmarks time it alone)."""
    M, K = x.shape
    O = packed.shape[1]
    split = cfg["SPLIT_K"]
    out = y if split == 1 else torch.empty(split, M, O, dtype=torch.float32, device=x.device)
    grid = (tables[2].numel(), triton.cdiv(O, cfg["BLOCK_O"]), split)
    _launch(_gemv_kernel, grid, x, packed, scales, y if bias is None else bias, out, *tables, M, O, K,
            x.stride(0), packed.stride(0), packed.stride(1), scales.stride(0), scales.stride(1),
            out.stride(0) if split > 1 else 0, out.stride(-2), HAS_BIAS=bias is not None, **cfg)
    if split > 1:
        torch.sum(out, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(out.sum(0))
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: x [N, K] -> [N, O]."""
    ids = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
    return mxfp4_grouped(x, packed[None], scales[None], ids, None if bias is None else bias[None])
