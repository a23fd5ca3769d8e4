"""Grouped MXFP4 expert matmul in Triton, straight from blocks and scales: a GEMV for decode, `tl.dot` tiles
for prefill, chosen by shape only.

Rows are grouped by expert on the device (triton_tiles.py: no host sync, no host-to-device copy, a grid
known from shapes, so a call can be captured in a CUDA graph); each program takes one tile of rows of ONE
expert and BLOCK_O output rows of that expert's weight.

- GEMV (at most GEMV_MAX_ROWS rows per expert on average): each program streams BLOCK_O whole rows of
  packed bytes, BLOCK_K / 2 contiguous bytes per row at a time (16-byte vector loads: only the last slice
  of a K that BLOCK_K does not divide is masked), decodes both nibbles of each byte in registers once for
  the tile's BLOCK_N rows and reduces with `tl.sum` per 32-value block, scaled once per block. Where rows
  are few (one token, few experts) K is split over SPLIT_K programs writing fp32 partials that one sum adds
  (deterministic, no atomics).
- `tl.dot` tiles (more rows per expert, prefill): the codes of a [BLOCK_O, BLOCK_K] slice are decoded and
  scaled in registers and multiplied by a tile of BLOCK_M rows with `tl.dot`: on tensor cores in bf16 for
  bf16 x (both operands exact in bf16), in fp32 ("ieee") for fp32 / fp16 x.

Decoding e2m1 (s e1 e0 m): the 3 magnitude bits shifted into an fp16's exponent and mantissa are the
value times 2^-14 (e = 0, m = 1 lands on fp16's subnormal 2^-15 = 0.5 * 2^-14), the sign bit goes to
bit 15; x is multiplied by 2^14 instead. On NVIDIA GPUs a few lines of PTX do this for 4 bytes at once
(_DECODE_PTX); elsewhere (the interpreter) the same bits come from Triton integer ops. Scales E8M0 are built
from their bits (2^(s-127), 0xFF = NaN), so the result is exact before the fp32 accumulation."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localmoe.kernels.mxfp4_moe.triton_tiles import _launch, max_tiles, plan

# Average rows per expert up to which the GEMV runs; above, tl.dot tiles. From sm_90 SASS of the loops (per
# byte of codes, all rows): GEMV 11.8 instructions at 1 row, 16 at 2, 25 at 4, 77 at 16; tl.dot tiles of 16
# rows 17-19 at any count. Instructions, not bytes, bound these kernels on an H200 (~3.3e13 lane-instructions/s
# against ~4.5e12 bytes/s), so the GEMV wins at 1-2 rows. benchmarks/gpu_kernels.py times both.
GEMV_MAX_ROWS = 2
SPLIT_K_TARGET = 1024  # programs wanted in flight before K is split (an H200 has 132 SMs)
MAX_SPLIT_K = 8


@triton.jit
def _e2m1_x16k(code):
    """Codes in the low 4 bits of int32 -> fp32 values times 2^-14 (exact: fp16 bits, subnormal for 0.5)."""
    bits = ((code & 7) << 9) | ((code & 8) << 12)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


# The same decode in PTX for 4 code bytes in one register ($4, byte i = element i): the fp16 patterns of the
# low nibbles ($0: elements 0 and 1, $1: 2 and 3) and of the high nibbles ($2, $3), two per 32-bit op.
# 11.5 instead of 17 instructions per code byte in the GEMV's loop (sm_90 SASS); the interpreter has no PTX.
_DECODE_PTX = tl.constexpr("""{
.reg .b32 t01, t23, a, b;
prmt.b32 t01, $4, 0, 0x4140;
prmt.b32 t23, $4, 0, 0x4342;
shl.b32 a, t01, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 12;
and.b32 b, b, 0x80008000;
or.b32 $0, a, b;
shl.b32 a, t23, 9;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 12;
and.b32 b, b, 0x80008000;
or.b32 $1, a, b;
shl.b32 a, t01, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t01, 8;
and.b32 b, b, 0x80008000;
or.b32 $2, a, b;
shl.b32 a, t23, 5;
and.b32 a, a, 0x0E000E00;
shl.b32 b, t23, 8;
and.b32 b, b, 0x80008000;
or.b32 $3, a, b;
}""")


@triton.jit
def _decode(codes, PTX: tl.constexpr):
    """uint8 code bytes -> (low nibbles, high nibbles) as fp32 values times 2^-14."""
    if PTX:
        lo, hi = tl.inline_asm_elementwise(_DECODE_PTX, "=r,=r,=r,=r,r", [codes], dtype=(tl.float16, tl.float16),
                                           is_pure=True, pack=4)
        return lo.to(tl.float32), hi.to(tl.float32)
    c = codes.to(tl.int32)
    return _e2m1_x16k(c), _e2m1_x16k(c >> 4)


@triton.jit
def _scale(sb):
    """E8M0 bytes (int32) -> fp32 2^(s - 127) from the bits: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    bits = tl.where(sb == 0, 0x400000, tl.where(sb == 255, 0x7FC00000, sb << 23))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _gemv_step(acc, x_ptr, rows, stride_xm, w_rows, s_rows, k0, K, mask_n, mask_o, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, MASK_K: tl.constexpr, PTX: tl.constexpr):
    """acc [BN, BO, NB] += this K slice's per-block sums, scaled. The codes are decoded once and used for each
    row in turn (3D [BO, NB, 16] math: a 4D [BN, BO, NB, 16] product spreads the 16-byte sums over lanes).
    Without MASK_K (whole slices) the code loads carry only row masks, so they stay 16-byte vectors."""
    blk = tl.arange(0, BLOCK_K // 32)
    kb = tl.multiple_of(k0 // 2, 16) + blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
    kx = k0 + blk[:, None] * 32 + tl.arange(0, 32)[None, :]  # [NB, 32]
    kblk = k0 // 32 + blk
    w_mask, s_mask = mask_o[:, None, None], mask_o[:, None]
    if MASK_K:
        w_mask, s_mask = w_mask & (kb < K // 2), s_mask & (kblk < K // 32)[None, :]
    lo, hi = _decode(tl.load(w_rows + kb, mask=w_mask, other=0), PTX)  # [BO, NB, 16]: elements 2i, 2i + 1
    scale = _scale(tl.load(s_rows + kblk[None, :], mask=s_mask, other=127).to(tl.int32))  # [BO, NB]
    slot = tl.arange(0, BLOCK_N)
    for n in tl.static_range(BLOCK_N):
        row = tl.sum(tl.where(slot == n, rows, 0), axis=0).to(tl.int64)
        valid = tl.sum(tl.where(slot == n, mask_n, False).to(tl.int32), axis=0)  # 1: a row of this tile
        xk = tl.load(x_ptr + row * stride_xm + kx, mask=kx < K * valid, other=0.0).to(tl.float32) * 16384.0
        xe, xo = tl.split(tl.reshape(xk, (BLOCK_K // 32, 16, 2)))  # [NB, 16] each
        part = tl.sum(lo * xe[None, :, :] + hi * xo[None, :, :], axis=2) * scale  # [BO, NB]
        if BLOCK_N == 1:
            acc += part[None, :, :]
        else:
            acc = tl.where((slot == n)[:, None, None], acc + part[None, :, :], acc)
    return acc


@triton.jit
def _gemv_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, rows_ptr, sorted_ptr, tile_start_ptr, tile_expert_ptr,
                 M, O, K, stride_xm, stride_pe, stride_po, stride_se, stride_so, stride_ys, stride_ym,
                 HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                 SPLIT_K: tl.constexpr, PTX: tl.constexpr):
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
        w_rows = p_ptr + e.to(tl.int64) * stride_pe + offs_o[:, None, None] * stride_po  # [BO, 1, 1]
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_o[:, None] * stride_so  # [BO, 1]
        per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
        k_lo = pid_k * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        k_whole = k_lo + (k_hi - k_lo) // BLOCK_K * BLOCK_K  # end of the whole BLOCK_K slices
        acc = tl.zeros((BLOCK_N, BLOCK_O, BLOCK_K // 32), dtype=tl.float32)  # per 32-value block, scaled
        for k0 in range(k_lo, k_whole, BLOCK_K):
            acc = _gemv_step(acc, x_ptr, rows, stride_xm, w_rows, s_rows, k0, K, mask_n, mask_o, BLOCK_N, BLOCK_K,
                             False, PTX)
        if k_whole < k_hi:  # the last split's partial slice (K not a multiple of BLOCK_K)
            acc = _gemv_step(acc, x_ptr, rows, stride_xm, w_rows, s_rows, k_whole, K, mask_n, mask_o, BLOCK_N,
                             BLOCK_K, True, PTX)
        out = tl.sum(acc, axis=2)
        if HAS_BIAS:
            bias = tl.load(b_ptr + e.to(tl.int64) * O + offs_o, mask=mask_o & (offs_o * 0 + pid_k == 0), other=0.0)
            out += bias.to(tl.float32)[None, :]
        tl.store(y_ptr + pid_k * stride_ys + rows[:, None].to(tl.int64) * stride_ym + offs_o[None, :],
                 out.to(y_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_o[None, :])


@triton.jit
def _dot_kernel(x_ptr, p_ptr, s_ptr, b_ptr, y_ptr, rows_ptr, sorted_ptr, tile_start_ptr, tile_expert_ptr,
                M, O, K, stride_xm, stride_pe, stride_po, stride_se, stride_so, stride_ym,
                HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_O: tl.constexpr, BLOCK_K: tl.constexpr,
                BF16: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr):
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
        blk = tl.arange(0, BLOCK_K // 32)
        w_rows = p_ptr + e.to(tl.int64) * stride_pe + offs_o[:, None, None] * stride_po  # [BO, 1, 1]
        s_rows = s_ptr + e.to(tl.int64) * stride_se + offs_o[:, None] * stride_so
        acc = tl.zeros((BLOCK_M, BLOCK_O), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kb = tl.multiple_of(k0 // 2, 16) + blk[None, :, None] * 16 + tl.arange(0, 16)[None, None, :]  # [1, NB, 16]
            kblk = k0 // 32 + blk
            w_mask, s_mask = mask_o[:, None, None], mask_o[:, None]
            if not EVEN_K:
                w_mask, s_mask = w_mask & (kb < K // 2), s_mask & (kblk < K // 32)[None, :]
            lo, hi = _decode(tl.load(w_rows + kb, mask=w_mask, other=0), PTX)  # [BO, NB, 16]
            scale = _scale(tl.load(s_rows + kblk[None, :], mask=s_mask, other=127).to(tl.int32))[:, :, None]
            w = tl.reshape(tl.join(lo * scale, hi * scale), (BLOCK_O, BLOCK_K))  # element 2i = low nibble of byte i
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


def ptx_decode(x: torch.Tensor) -> bool:
    """Whether the GEMV decodes codes with its PTX (an NVIDIA GPU; not the interpreter, not ROCm)."""
    return x.is_cuda and torch.version.hip is None


def gemv_config(M: int, E: int, O: int, K: int, max_rows: int = GEMV_MAX_ROWS) -> dict | None:
    """Tile sizes of the GEMV for M rows over E experts (shapes only), or None where `tl.dot` tiles are used
    (more than `max_rows` rows per expert on average; at most 16)."""
    per_expert = triton.cdiv(M, min(E, M))
    if per_expert > min(max_rows, 16):
        return None
    block_n = triton.next_power_of_2(per_expert)
    # the fewest instructions per byte without spilling (sm_90 SASS, 4 warps)
    block_o, block_k = {1: (32, 256), 2: (16, 256), 4: (32, 256), 8: (32, 256), 16: (32, 128)}[block_n]
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
                BLOCK_O=64, BLOCK_K=64, BF16=x.dtype == torch.bfloat16, EVEN_K=K % 64 == 0, PTX=ptx_decode(x))
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
            out.stride(0) if split > 1 else 0, out.stride(-2), HAS_BIAS=bias is not None,
            **{"PTX": ptx_decode(x), **cfg})
    if split > 1:
        torch.sum(out, dim=0, out=y) if y.dtype == torch.float32 else y.copy_(out.sum(0))
    return y


def mxfp4_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """One expert: x [N, K] -> [N, O]."""
    ids = torch.zeros(x.shape[0], dtype=torch.int32, device=x.device)
    return mxfp4_grouped(x, packed[None], scales[None], ids, None if bias is None else bias[None])
