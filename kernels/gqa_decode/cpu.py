"""The CPU fast path: `gqa_cpu.cpp` (AVX2 + FMA) in the localmoe CPU library (kernels/_cpu)."""

from __future__ import annotations

import ctypes

import torch
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.fp8_cache.cpu import cache_rows
from localmoe.kernels.gqa_decode.reference import PagedKV

MAX_DIM = 512


def supported(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (fp32 on the CPU, rows contiguous, D % 8 == 0)."""
    D = q.shape[-1]
    return (q.device.type == keys.device.type == values.device.type == "cpu"
            and q.dtype == keys.dtype == values.dtype == torch.float32 and D % 8 == 0 and D <= MAX_DIM
            and q.stride(-1) == keys.stride(-1) == values.stride(-1) == 1 and library() is not None)


def gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
               visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As reference.naive_gqa_decode; q [B, H, D], keys/values [B, Hkv, S, D] through their strides."""
    B, H, D = q.shape
    Hkv, S = keys.shape[1], keys.shape[2]
    assert H % Hkv == 0 and values.shape == keys.shape and keys.shape[-1] == D, "q [B, H, D], k/v [B, Hkv, S, D]"
    if visible is not None:
        visible = visible.to(torch.bool).contiguous()
        assert tuple(visible.shape) == (B, S), f"visible {tuple(visible.shape)} against [{B}, {S}]"
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = q.new_empty(B, H, D)
    library().gqa_decode(q.data_ptr(), q.stride(0), q.stride(1), B, H, H // Hkv, D,
                         keys.data_ptr(), keys.stride(0), keys.stride(1), keys.stride(2),
                         values.data_ptr(), values.stride(0), values.stride(1), values.stride(2), first, S,
                         None if visible is None else visible.data_ptr(), S,
                         None if sinks is None else sinks.data_ptr(), scale, out.data_ptr(), threads())
    return out


def _address(c: PagedKV) -> tuple[int, ...] | None:
    """The kernel's row fields of a sequence's cache (paged_cpu.cpp: key pool, key table, key head
    stride, value pool, value table, value head stride, block, capacity in positions), then Hkv and D;
    None where the kernel cannot read it (fp32 contiguous CPU pools, long tables)."""
    kp, kt, vp, vt = c.key_pool, c.key_table, c.value_pool, c.value_table
    if not (kp.dtype == vp.dtype == torch.float32 and kp.device.type == vp.device.type == "cpu"
            and kp.is_contiguous() and vp.is_contiguous() and kp.shape == vp.shape and kp.shape[3] % 8 == 0
            and kt.dtype == vt.dtype == torch.long and kt.is_contiguous() and vt.is_contiguous()
            and kt.device.type == vt.device.type == "cpu"):
        return None
    block = kp.shape[2]
    return (kp.data_ptr(), kt.data_ptr(), kp.stride(0), vp.data_ptr(), vt.data_ptr(), vp.stride(0), block,
            min(kt.numel(), vt.numel()) * block, kp.shape[0], kp.shape[3])


def address(c: PagedKV) -> tuple[int, ...] | None:
    """`_address`, computed once per PagedKV (its tensors do not change; a cache that grows makes a new one)."""
    if c.address is None:
        c.address = _address(c) or ()
    return c.address or None


def paged_supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[PagedKV]) -> bool:
    """Whether gqa_decode_paged takes these: fp32 CPU q/k/v with contiguous rows, D % 8 == 0, and every
    row's cache readable by the kernel (`address`)."""
    return (supported(q, k.unsqueeze(2), v.unsqueeze(2)) and k.stride(-1) == v.stride(-1) == 1
            and all(address(c) is not None for c in caches))


def paged_fields(c: PagedKV, kv_heads: int, head_dim: int) -> tuple[int, ...]:
    """The kernel's first 8 fields of a row over cache c (`address`: pools, tables, head strides, block,
    capacity); `paged_supported` must hold for c, and its pools must have these heads and dim."""
    fields = c.address
    assert fields[8:] == (kv_heads, head_dim), f"pool {tuple(c.key_pool.shape)} against [{kv_heads}, P, block, {head_dim}]"
    return fields[:8]


def cached_fields(keys: tuple, values: tuple, kv_heads: int, head_dim: int) -> tuple[tuple[int, ...], tuple] | None:
    """The kernel's first 8 fields of a row over a bf16 / fp8 cache read and written in its own dtype (paged_cpu.cpp:
    the addresses of the keys' and values' kernels/fp8_cache `CacheRows`, tables 0, block 1, capacity) and those two
    views (the caller holds them while the fields are used); keys, values: `PagedBuffer.storage` of the cache's
    buffers. None where the kernel cannot read them (not on the CPU, an fp32 pool: use `paged_fields`, D % 8)."""
    if not (keys[0].device.type == values[0].device.type == "cpu" and keys[0].dtype == values[0].dtype != torch.float32
            and head_dim % 8 == 0 and head_dim <= MAX_DIM):
        return None
    views = cache_rows(*keys), cache_rows(*values)
    assert all((v.heads, v.dim) == (kv_heads, head_dim) for v in views), \
        f"cache rows {views[0].heads} x {views[0].dim} against {kv_heads} x {head_dim}"
    fields = (ctypes.addressof(views[0]), 0, 0, ctypes.addressof(views[1]), 0, 0, 1,
              min(views[0].capacity, views[1].capacity))
    return fields, views


def gqa_decode_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[PagedKV], positions, firsts,
                     scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """As reference.naive_gqa_decode_paged (q [N, H, D], k/v [N, Hkv, D] through their strides), in one
    call (paged_cpu.cpp); `paged_supported` must hold."""
    N, Hkv, D = q.shape[0], k.shape[1], q.shape[2]
    assert len(caches) == len(positions) == len(firsts) == N, "one cache, position and first key per row"
    seqs = torch.tensor([paged_fields(c, Hkv, D) + (pos, first) for c, pos, first in zip(caches, positions, firsts)],
                        dtype=torch.long).view(N, 10)
    return gqa_decode_rows(q, k, v, seqs, scale, sinks)


def gqa_decode_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqs: torch.Tensor, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """gqa_decode_paged with the rows' fields already made: seqs [N, 10] int64 contiguous, row n's
    `paged_fields` (of caches that `paged_supported` took, with these heads and dim), its position and its
    first key; q/k/v as `supported` takes them. A caller that runs many layers over the same sequences builds
    every layer's fields once per step (engine/batch.py)."""
    N, H, D = q.shape
    Hkv = k.shape[1]
    assert H % Hkv == 0 and k.shape == v.shape == (N, Hkv, D), f"q {tuple(q.shape)}, k/v {tuple(k.shape)}"
    assert seqs.shape == (N, 10) and seqs.dtype == torch.long and seqs.is_contiguous(), f"seqs {tuple(seqs.shape)}"
    if sinks is not None:
        sinks = sinks.float().contiguous()
    out = q.new_empty(N, H, D)
    bad = library().gqa_decode_paged(q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1),
                                     v.data_ptr(), v.stride(0), v.stride(1), N, H, H // Hkv, D, seqs.data_ptr(),
                                     None if sinks is None else sinks.data_ptr(), scale, out.data_ptr(), threads())
    assert bad < 0, f"row {bad}: position {int(seqs[bad, 8])} lies past the cache's {int(seqs[bad, 7])} positions"
    return out


class StepKernel:
    """`gqa_step` (step_cpu.cpp) bound to one layer's weights, checked once: call with x [..., hidden]
    (one token, fp32 contiguous), the RoPE tables at this position (cos, signed sin [rot] fp32
    contiguous), the fp32 cache pools keys/values [1, Hkv, capacity, D] (positions contiguous per
    head) with room for `pos`, the position and the window's first key -> [..., hidden] fp32."""

    def __init__(self, wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None,
                 heads: int, kv_heads: int, head_dim: int, rot: int, sinks: torch.Tensor | None, scale: float,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 0.0):
        self.wqkv, self.bqkv, self.wo, self.bo, self.sinks = wqkv, bqkv, wo, bo, sinks
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, eps
        self.heads, self.kv_heads, self.head_dim, self.rot, self.scale = heads, kv_heads, head_dim, rot, scale
        self.hidden = wo.shape[0]
        self.scratch_floats = library().gqa_step_scratch(heads, kv_heads, head_dim)

    @staticmethod
    def takes(wqkv: torch.Tensor, bqkv: torch.Tensor | None, wo: torch.Tensor, bo: torch.Tensor | None, heads: int,
              kv_heads: int, head_dim: int, rot: int, sinks: torch.Tensor | None,
              q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None) -> bool:
        """Whether the kernel can run a layer of these weights (contiguous fp32/bf16 CPU matrices of the
        right shapes, fp32 biases, sinks and q/k norms (both or neither), D % 8 == 0 and even rot) and
        the library is built."""
        rows = (heads + 2 * kv_heads) * head_dim
        return (library() is not None and head_dim % 8 == 0 and head_dim <= MAX_DIM and rot % 2 == 0
                and 0 < rot <= head_dim and heads % kv_heads == 0
                and wqkv.dim() == wo.dim() == 2 and wqkv.shape[0] == rows and wo.shape[1] == heads * head_dim
                and wqkv.shape[1] == wo.shape[0]
                and all(w.dtype in (torch.float32, torch.bfloat16) and w.device.type == "cpu" and w.is_contiguous()
                        for w in (wqkv, wo))
                and all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu")
                        for t in (bqkv, bo, sinks, q_norm, k_norm))
                and (q_norm is None) == (k_norm is None)
                and all(t is None or t.shape == (head_dim,) for t in (q_norm, k_norm))
                and (bqkv is None or bqkv.shape == (rows,)) and (bo is None or bo.shape == (wo.shape[0],))
                and (sinks is None or sinks.shape == (heads,)))

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                 values: torch.Tensor, pos: int, first: int) -> torch.Tensor:
        out = x.new_empty(x.shape)
        scratch = torch.empty(self.scratch_floats)
        library().gqa_step(x.data_ptr(), self.hidden, self.wqkv.data_ptr(), int(self.wqkv.dtype == torch.bfloat16),
                           None if self.bqkv is None else self.bqkv.data_ptr(), self.heads, self.kv_heads,
                           self.head_dim, self.rot, cos.data_ptr(), signed_sin.data_ptr(), keys.data_ptr(),
                           values.data_ptr(), keys.stride(1), pos, first,
                           None if self.sinks is None else self.sinks.data_ptr(), self.scale,
                           None if self.q_norm is None else self.q_norm.data_ptr(),
                           None if self.k_norm is None else self.k_norm.data_ptr(), self.eps, self.wo.data_ptr(),
                           int(self.wo.dtype == torch.bfloat16), None if self.bo is None else self.bo.data_ptr(),
                           out.data_ptr(), scratch.data_ptr(), threads())
        return out
