"""Grouped-query attention decode (one new query per sequence): `gqa_decode` runs the CPU kernel for
fp32 CPU tensors where the library is built, else the reference; `gqa_decode_paged` writes N
sequences' new K/V rows into their own paged caches and attends for all of them in one call (the
batched decode step; `gqa_decode_rows` is that call with the rows' kernel fields made by the caller,
`kernel_fields`, once per step for every layer); `step_kernel_for` binds a layer's
weights to the fused decode step (QKV GEMV, RoPE, cache write, attention, output GEMV in one call;
reference: `naive_gqa_step`) where the kernel can take them."""

from __future__ import annotations

import torch
from localmoe.kernels.gqa_decode import cpu
from localmoe.kernels.gqa_decode.reference import PagedKV, naive_gqa_decode, naive_gqa_decode_paged, naive_gqa_step


def gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
               visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D], keys/values [B, Hkv, S, D] -> [B, H, D] fp32 (see reference.naive_gqa_decode)."""
    if cpu.supported(q, keys, values):
        return cpu.gqa_decode(q, keys, values, scale, first, visible, sinks)
    return naive_gqa_decode(q, keys, values, scale, first, visible, sinks)


def gqa_decode_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[PagedKV], positions, firsts,
                     scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, H, D], new rows k/v [N, Hkv, D], caches[n]: row n's sequence's PagedKV -> [N, H, D] fp32
    (see reference.naive_gqa_decode_paged)."""
    if cpu.paged_supported(q, k, v, caches):
        return cpu.gqa_decode_paged(q, k, v, caches, positions, firsts, scale, sinks)
    return naive_gqa_decode_paged(q, k, v, caches, positions, firsts, scale, sinks)


def kernel_fields(c: PagedKV, kv_heads: int, head_dim: int) -> tuple[int, ...] | None:
    """The CPU kernel's first 8 fields of a row over cache c with these heads and dim (cpu.paged_fields:
    addresses, strides, block, capacity), or None where the kernel cannot read c (use gqa_decode_paged)."""
    return cpu.paged_fields(c, kv_heads, head_dim) if cpu.address(c) is not None else None


def cached_fields(keys: tuple, values: tuple, kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], tuple] | None:
    """The CPU kernel's first 8 fields of a row over a bf16 / fp8 cache read and written in its own dtype, and the
    kernels/fp8_cache `CacheRows` views they point at (held by the caller while the fields are used); keys, values:
    `PagedBuffer.storage` of its buffers. None where the kernel cannot read them (cpu.cached_fields)."""
    return cpu.cached_fields(keys, values, kv_heads, head_dim)


def rows_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether gqa_decode_rows takes q [N, H, D] and the new rows k/v [N, Hkv, D] (else use gqa_decode_paged)."""
    return cpu.supported(q, k.unsqueeze(2), v.unsqueeze(2)) and k.stride(-1) == v.stride(-1) == 1


def gqa_decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """gqa_decode_paged through the CPU kernel with the rows' fields made by the caller: seqs [N, 10] int64,
    row n's `kernel_fields`, position and first key (see cpu.gqa_decode_rows); `rows_supported` must hold."""
    return cpu.gqa_decode_rows(q, k, v, seqs, scale, sinks)


StepKernel = cpu.StepKernel  # the type step_kernel_for returns


def step_kernel_for(wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None,
                    heads: int, kv_heads: int, head_dim: int, rot: int, sinks: torch.Tensor | None,
                    scale: float, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                    eps: float = 0.0) -> cpu.StepKernel | None:
    """The fused decode step for a layer of these weights (see cpu.StepKernel; q_norm / k_norm: Qwen3's
    per-head RMSNorm before RoPE, with `eps`), or None where the CPU kernel cannot take them (then run
    the step op by op)."""
    if not cpu.StepKernel.takes(wqkv, bqkv, wo, bo, heads, kv_heads, head_dim, rot, sinks, q_norm, k_norm):
        return None
    return cpu.StepKernel(wqkv, bqkv, wo, bo, heads, kv_heads, head_dim, rot, sinks, scale, q_norm, k_norm, eps)


__all__ = ["PagedKV", "StepKernel", "cached_fields", "gqa_decode", "gqa_decode_paged", "gqa_decode_rows", "kernel_fields",
           "naive_gqa_decode", "naive_gqa_decode_paged", "naive_gqa_step", "rows_supported", "step_kernel_for"]
