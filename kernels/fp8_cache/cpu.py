"""A cache buffer as the CPU kernels read and write it in place (cache_rows.h `CacheRows`): fp32, bf16 or fp8
values with fp8's per-row scales and the exact ring of the newest positions, from the tensors a caller holds
(engine/cache.py `PagedBuffer.storage`)."""

from __future__ import annotations

import ctypes

import torch
from localmoe.kernels._cpu import library

_p, _i = ctypes.c_void_p, ctypes.c_int64
DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2}  # cache_rows.h kF32, kBF16, kFP8


class CacheRows(ctypes.Structure):
    """cache_rows.h `struct CacheRows`."""

    _fields_ = [("dtype", _i), ("pool", _p), ("scales", _p), ("recent", _p), ("recent_pos", _p), ("heads", _i),
                ("dim", _i), ("capacity", _i), ("ring", _i)]


def cache_rows(pool: torch.Tensor, scales: torch.Tensor | None, recent: torch.Tensor | None,
               recent_pos: torch.Tensor | None) -> CacheRows:
    """pool [H, capacity, D] (fp32, bf16 or float8_e4m3fn), scales [H, capacity] fp32 (fp8), recent [H, ring, D]
    fp32 and recent_pos [ring] int64 (bf16 / fp8), all contiguous on the CPU -> the kernel's view of them."""
    H, capacity, D = pool.shape
    if pool.dtype not in DTYPES or not pool.is_contiguous() or pool.device.type != "cpu":
        raise ValueError(f"cache pool: {pool.dtype} {tuple(pool.shape)}; a contiguous CPU fp32/bf16/fp8 pool is needed")
    lossy = pool.dtype != torch.float32
    ring = recent.shape[1] if lossy else 0
    if lossy and (recent is None or recent_pos is None or recent.shape != (H, ring, D) or ring < 1
                  or recent.dtype != torch.float32 or not recent.is_contiguous() or recent_pos.dtype != torch.int64):
        raise ValueError("a bf16 / fp8 cache pool needs its exact ring: recent [H, ring, D] fp32, recent_pos [ring]")
    if (scales is None) != (pool.dtype != torch.float8_e4m3fn) or (
            scales is not None and (scales.shape != (H, capacity) or not scales.is_contiguous())):
        raise ValueError("an fp8 cache pool needs its scales [H, capacity] (and only an fp8 one has them)")
    ptr = (lambda t: None if t is None else t.data_ptr())
    return CacheRows(DTYPES[pool.dtype], pool.data_ptr(), ptr(scales), ptr(recent) if lossy else None,
                     ptr(recent_pos) if lossy else None, H, D, capacity, ring)


def write(rows: CacheRows, pos: int, x: torch.Tensor) -> None:
    """Store x [H * D] fp32 at position `pos` (the kernel's write: quantised rows, the ring)."""
    library().cache_rows_write(ctypes.byref(rows), pos, x.contiguous().float().data_ptr())


def read(rows: CacheRows, head: int, s: int, length: int) -> torch.Tensor:
    """Head `head`'s row at position s of a buffer holding `length` positions, fp32 [D] (the kernel's read)."""
    out = torch.empty(rows.dim)
    library().cache_rows_read(ctypes.byref(rows), head, s, length, out.data_ptr())
    return out
