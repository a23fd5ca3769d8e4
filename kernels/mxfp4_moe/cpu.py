"""The CPU fast path: `mxfp4_cpu.cpp` (AVX2 + FMA), part of the localmoe CPU library.

The library (kernels/_cpu: all C++ kernel sources in one shared object, compiled on first use,
loaded with ctypes, one persistent thread pool) is shared with the dense GEMV; `library()` is
its loader. A row is always computed whole by one thread, so results do not depend on the
thread count. (OpenMP inside the library, sharing torch's libgomp, was measured first: its
spin-waiting made 2 threads 6x slower than 1 on a shared 2-core machine; the Python thread pool
used before split the rows statically, so a core busy with another process held every call up.)
Where the library is unavailable, `library()` returns None and the dispatcher uses the reference.

Why C++ and not torch: measured on a 2-core Zen 3 (docs/performance.md, "Kernels"), the
reference's dequantise (a gather per byte) + fp32 F.linear is far from memory bandwidth for
decode, and bf16 matmuls are slow without AVX512-BF16; decoding each 32-element block in
registers and using it at once streams the weights. For one token the GEMV splits x into integer
parts per 32-element block (int16 + int8, within ~2^-23 of the block's largest value) so that the
block dot products are integer multiply-adds (mxfp4_cpu.cpp); `dequantize` is exact.
"""

from __future__ import annotations

import threading

import torch
from localmoe.kernels._cpu import _state, library, threads

_local = threading.local()  # .scratch: this thread's buffer for `moe`
MAX_EXPERTS = 1024  # route.h kMaxExperts

__all__ = ["_state", "dequantize", "gemv", "library", "moe"]


def _check(x: torch.Tensor | None, packed: torch.Tensor, scales: torch.Tensor) -> None:
    O, K = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == scales.dtype == torch.uint8 and packed.dim() == scales.dim() == 2, "uint8 codes, scales"
    assert K % 32 == 0 and tuple(scales.shape) == (O, K // 32), f"scales {tuple(scales.shape)}, codes [{O}, {K // 2}]"
    assert packed.is_contiguous() and scales.is_contiguous() and packed.device.type == "cpu"
    if x is not None:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == K and x.is_contiguous(), "x: fp32 [N, K]"


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, q8: bool = False) -> torch.Tensor:
    """x [N, K] fp32 -> x W^T [N, O] fp32, straight from MXFP4 (packed [O, K/2], scales [O, K/32]);
    q8: x rounded to int8 per 32-element block first (reference.q8_round). The same bits for a token
    whatever the thread count, and with q8 whatever N (the fused MoE layer's bits too)."""
    x, packed, scales = x.contiguous(), packed.contiguous(), scales.contiguous()
    _check(x, packed, scales)
    N, K, O = x.shape[0], x.shape[1], packed.shape[0]
    lib, y = library(), x.new_empty(N, O)
    scratch = torch.empty(lib.mxfp4_gemv_scratch(N, K, int(q8)), dtype=torch.uint8)
    lib.mxfp4_gemv(x.data_ptr(), N, K, packed.data_ptr(), scales.data_ptr(), O, y.data_ptr(), scratch.data_ptr(),
                   threads(), int(q8))
    return y


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed [O, K/2], scales [O, K/32] -> fp32 [O, K], equal to quant.mxfp4.dequantize (-0 as +0)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    _check(None, packed, scales)
    w = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    library().mxfp4_dequantize(packed.data_ptr(), scales.data_ptr(), scales.numel(), w.data_ptr(),
                               threads())
    return w


SCRATCH_KEEP_BYTES = 8 << 20  # a scratch up to this size is kept for the thread's next call (decode sizes)


def _scratch(nbytes: int) -> torch.Tensor:
    """A scratch buffer of at least `nbytes`: this thread's, kept between calls while it is at most
    SCRATCH_KEEP_BYTES (decode calls the MoE kernel once per layer and step with the same sizes);
    a larger one (a prefill chunk's) is the call's own, so it is freed with the chunk."""
    if nbytes > SCRATCH_KEEP_BYTES:
        return torch.empty(nbytes, dtype=torch.uint8)
    buf = getattr(_local, "scratch", None)
    if buf is None or buf.numel() < nbytes:
        buf = _local.scratch = torch.empty(nbytes, dtype=torch.uint8)
    return buf


def moe(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table: torch.Tensor, I: int, glu: int,
        params: tuple[float, float], out: torch.Tensor, only: int = -1, q8: bool = False,
        rows: int | None = None) -> torch.Tensor:
    """out [N, D] += the routed experts of x [N, D] (moe_cpu.cpp): ids [N, k] int64, weights [N, k],
    table int64 [E, 9] of expert addresses (ExpertTable), I the experts' width, glu 0/1/2 (swiglu,
    gpt-oss, SiTU) with `params`; `only` >= 0: that expert alone; `q8`: projection inputs rounded to
    int8 per 32-element block. x, out and weights are fp32 and, like ids, contiguous on the CPU (the
    dispatcher's guard; not checked again here). `rows`: with `only`, how many of ids are that expert's
    (its scratch is sized for those alone; default N * k, enough for any)."""
    N, D = x.shape
    k = ids.shape[1]
    lib = library()
    scratch = _scratch(lib.mxfp4_moe_scratch(N * k if only < 0 or rows is None else rows, D, I))
    lib.mxfp4_moe(x.data_ptr(), N, D, I, k, ids.data_ptr(), weights.data_ptr(), table.data_ptr(), table.shape[0],
                  only, glu, params[0], params[1], out.data_ptr(), scratch.data_ptr(), threads(), int(q8))
    return out


def route(router_x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
          correction: torch.Tensor | None, scoring: int, top_k: int, renormalize: bool,
          scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of `moe_routed` alone (moe_cpu.cpp `mxfp4_route`, the same bits): (weights, ids) [N, k]."""
    N, E = router_x.shape[0], router_weight.shape[0]
    ids = torch.empty(N, top_k, dtype=torch.int64)
    weights, logits = torch.empty(N, top_k), torch.empty(N, E)
    library().mxfp4_route(router_x.data_ptr(), router_x.shape[1], router_weight.data_ptr(),
                          None if router_bias is None else router_bias.data_ptr(),
                          None if correction is None else correction.data_ptr(), scoring, int(renormalize), scaling,
                          N, top_k, E, ids.data_ptr(), weights.data_ptr(), logits.data_ptr(), threads())
    return weights, ids


def moe_routed(router_x: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None,
               correction: torch.Tensor | None, scoring: int, top_k: int, renormalize: bool, scaling: float,
               x: torch.Tensor, table: torch.Tensor, I: int, glu: int, params: tuple[float, float],
               out: torch.Tensor, q8: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`moe` with the routing in the same call (moe_cpu.cpp `mxfp4_moe_routed`): router logits of
    router_x [N, R] through router_weight fp32 [E, R] (+ router_bias), route.h's rule (scoring 0/1/2,
    correction [E] or None), then the experts on x [N, D]. Every tensor fp32 and contiguous on the CPU
    (the dispatcher's guard). Returns (out, weights [N, k], ids [N, k])."""
    N, D = x.shape
    E = router_weight.shape[0]
    lib = library()
    scratch = _scratch(lib.mxfp4_moe_routed_scratch(N, top_k, D, I, E))
    ids = torch.empty(N, top_k, dtype=torch.int64)
    weights = torch.empty(N, top_k)
    lib.mxfp4_moe_routed(router_x.data_ptr(), router_x.shape[1], router_weight.data_ptr(),
                         None if router_bias is None else router_bias.data_ptr(),
                         None if correction is None else correction.data_ptr(), scoring, int(renormalize), scaling,
                         x.data_ptr(), N, D, I, top_k, table.data_ptr(), table.shape[0], glu, params[0], params[1],
                         out.data_ptr(), ids.data_ptr(), weights.data_ptr(), scratch.data_ptr(), threads(), int(q8))
    return out, weights, ids
