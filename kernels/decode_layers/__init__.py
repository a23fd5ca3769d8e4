"""Every layer of a model for one decode token in one kernel call (layers_cpu.cpp), for the engine's
single-sequence decode: `GqaMoeDecoder` for GQA + routed-MXFP4-MoE models (gpt-oss),
`DenseDecoder` for GQA + SiLU-gated dense MLP models (Llama, SmolLM2, Qwen2, Qwen3). Their K/V caches are fp32
pools (`set_pools`) or bf16 / fp8 buffers read and written in their own dtype (`set_storage`, kernels/fp8_cache
cache_rows.h: the engine's rounding and exact ring, as the hybrid plan's GQA layers).

They string together kernels that have their own references and tests (rms_norm, the fused
gqa_decode step, mxfp4_routed_moe, the dense and GGUF-block GEMVs) in the order the engine runs
the layers op by op. The MoE decoder calls the same entry points as the op-by-op step, so the two
give the same bits (tests/models/test_gpt_oss.py); the dense one is checked against the op-by-op
step and against transformers (tests/models/test_llama_tiny.py, test_smollm2_gguf.py). Each holds
its layers as a ctypes array built once; the caller updates each layer's cache pools when they move
(`set_pools`) and calls it per token. `rows` runs the stack for N sequences at once over their paged caches (the
batched decode step and a speculative verify, engine/batch.py), each row with the bits of its call alone. A MoE
layer whose experts a pager holds calls back into the engine (`experts`) for its experts, in both forms.
"""

from __future__ import annotations

import ctypes

import torch
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.fp8_cache.cpu import CacheRows, cache_rows

_p, _i, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class Layer(ctypes.Structure):
    """layers_cpu.cpp `struct Layer`, field for field."""

    _fields_ = [("attn_norm", _p), ("wqkv", _p), ("bqkv", _p), ("wo", _p), ("bo", _p), ("sinks", _p),
                ("kpool", _p), ("vpool", _p), ("qkv_bf16", _i), ("o_bf16", _i), ("heads", _i), ("kv_heads", _i),
                ("head_dim", _i), ("rot", _i), ("head_stride", _i), ("window", _i), ("scale", _f),
                ("mlp_norm", _p), ("router_w", _p), ("router_b", _p), ("correction", _p), ("table", _p),
                ("scoring", _i), ("renormalize", _i), ("experts", _i), ("intermediate", _i), ("top_k", _i),
                ("glu", _i), ("scaling", _f), ("p0", _f), ("p1", _f), ("keys", CacheRows), ("values", CacheRows)]


class Matrix(ctypes.Structure):
    """kernels/_cpu/matrix.h `struct Matrix`: type 0 fp32, 1 bf16, a GGMLQuantizationType value (2 Q4_0,
    3 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q8_0, 12 Q4_K, 13 Q5_K, 14 Q6_K) for raw GGUF blocks (Q8_0 + X16: on x rounded to int16),
    or STACKED: data is an array of these five 64-bit fields per part (an int64 tensor [parts + 1, 5], the last row
    zero)."""

    _fields_ = [("data", _p), ("type", _i), ("rows", _i), ("cols", _i), ("bias", _p)]


MATRIX_TYPES = {torch.float32: 0, torch.bfloat16: 1}
# GGMLQuantizationType Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K, and 259 / 268 / 270: Q4_1_R8 / Q4_K_R8 / Q6_K_R8
# (Q4_1 / Q4_K / Q6_K repacked at load, kernels/ggml_gemv/repacked.py); 20 / 23: IQ4_NL / IQ4_XS (ggml_rows_iq4.h)
GGML_MATRIX_TYPES = (2, 3, 6, 7, 8, 12, 13, 14, 259, 268, 270, 20, 23)
X16 = 0x1000  # added to Q8_0's type: the matrix reads x rounded to int16 per 32 (matrix.h kX16, a BlockLinear.x16)
STACKED = 255


class DenseLayer(ctypes.Structure):
    """layers_cpu.cpp `struct DenseLayer`, field for field."""

    _fields_ = [("attn_norm", _p), ("qkv", Matrix), ("o", Matrix), ("q_norm", _p), ("k_norm", _p), ("sinks", _p),
                ("kpool", _p), ("vpool", _p),
                ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("rot", _i), ("head_stride", _i), ("window", _i),
                ("scale", _f), ("mlp_norm", _p), ("gate_up", Matrix), ("down", Matrix), ("keys", CacheRows),
                ("values", CacheRows)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def available() -> bool:
    return library() is not None


class _Pools:
    pools: list[tuple | None]  # what each layer's cache fields were set from: fp32 pools' (addresses, stride), or the
    # bf16 / fp8 buffers' two `PagedBuffer.storage` tuples
    layers: ctypes.Array

    def set_pools(self, i: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Layer i's fp32 cache pools [1, Hkv, capacity, D] (they move when the cache grows)."""
        now = (keys.data_ptr(), values.data_ptr(), keys.stride(1))
        held = self.pools[i]
        if held is None or len(held) != 3 or held != now:
            self.pools[i] = now
            layer = self.layers[i]
            layer.kpool, layer.vpool, layer.head_stride = now
            layer.keys.pool = None  # the kernel reads kpool / vpool

    def set_storage(self, i: int, keys: tuple, values: tuple) -> None:
        """Layer i's bf16 / fp8 K/V caches, read and written in their own dtype (kernels/fp8_cache `cache_rows`):
        `PagedBuffer.storage` of the keys and of the values, the same tuples until a buffer changes (only then is
        the layer's view made again)."""
        held = self.pools[i]
        if held is None or len(held) != 2 or held[0] is not keys or held[1] is not values:
            self.pools[i] = (keys, values)
            layer = self.layers[i]
            layer.keys, layer.values = cache_rows(*keys), cache_rows(*values)


MoeExpertsFn = ctypes.CFUNCTYPE(ctypes.c_int, _i, _i, _p, _p)  # layers_cpu.cpp MoeExperts


class GqaMoeDecoder(_Pools):
    """`decode_gqa_moe` bound to a model's layers. Each entry of `layers` is a dict with the attention's
    tensors (attn_norm, wqkv, bqkv, wo, bo, sinks: fp32 or bf16 matrices, fp32 vectors, contiguous),
    its shape (heads, kv_heads, head_dim, rot, window, scale), the MoE's (mlp_norm, router_w fp32
    [E, D], router_b, correction, table: ExpertTable.addresses, or None for a layer whose experts a pager
    holds, scoring index, renormalize, scaling, intermediate, top_k, glu index, p0, p1). `experts(layer, h)`:
    layer `layer`'s routed-expert sum [N, D] of the rows h [N, D] for a layer without a table (the engine routes
    and dispatches them: the same kernels and order). `moe_rows`: the most rows of one resident MoE kernel call
    that keep each row's bits alone (kernels/mxfp4_moe EXACT_TOKEN_ROWS at exact precision). The tensors are held
    here, so the pointers stay valid."""

    def __init__(self, layers: list[dict], hidden: int, final_norm: torch.Tensor, eps: float, q8: bool,
                 experts=None, moe_rows: int = 32):
        self.held = [layers, final_norm]
        self.hidden, self.final_norm, self.eps, self.q8 = hidden, final_norm, eps, q8
        self.layers = (Layer * len(layers))()
        self.moe_rows, self.experts, self.error = moe_rows, experts, None
        self.callback = MoeExpertsFn(self._experts)
        lib = library()
        attn_floats = top_k = 0
        self.moe_shapes = []  # (k, intermediate, experts) of each layer with a resident table
        for c, d in zip(self.layers, layers):
            for name in ("attn_norm", "wqkv", "bqkv", "wo", "bo", "sinks", "mlp_norm", "router_w", "router_b",
                         "correction", "table"):
                setattr(c, name, _ptr(d[name]))
            c.qkv_bf16, c.o_bf16 = int(d["wqkv"].dtype == torch.bfloat16), int(d["wo"].dtype == torch.bfloat16)
            for name in ("heads", "kv_heads", "head_dim", "rot", "window", "scoring", "renormalize", "intermediate",
                         "top_k", "glu"):
                setattr(c, name, int(d[name]))
            c.experts = d["router_w"].shape[0]
            c.scale, c.scaling, c.p0, c.p1 = d["scale"], d["scaling"], d["p0"], d["p1"]
            attn_floats = max(attn_floats, lib.gqa_step_scratch(c.heads, c.kv_heads, c.head_dim))
            if d["table"] is not None:
                self.moe_shapes.append((c.top_k, c.intermediate, c.experts))
            top_k = max(top_k, c.top_k)
        self.attn_scratch = torch.empty(attn_floats)
        self.moe_scratch = torch.empty(self._moe_bytes(1), dtype=torch.uint8)
        self.delta, self.weights = torch.empty(hidden), torch.empty(top_k)
        self.ids = torch.empty(top_k, dtype=torch.int64)
        self.pools: list[tuple[int, int, int] | None] = [None] * len(layers)
        self.row_floats = lib.decode_gqa_moe_rows_work(ctypes.addressof(self.layers), len(self.layers))
        self.row_buffers: tuple | None = None  # rows, work, delta, ids, weights, moe scratch

    def _moe_bytes(self, rows: int) -> int:
        return max([library().mxfp4_moe_routed_scratch(rows, k, self.hidden, inner, E)
                    for k, inner, E in self.moe_shapes] + [64])

    def _experts(self, layer: int, n: int, h: int, out: int) -> int:
        try:
            y = self.experts(layer, _floats(h, n * self.hidden).view(n, self.hidden))
            _floats(out, n * self.hidden).view(n, self.hidden).copy_(y.view(n, self.hidden))
            return 0
        except BaseException as e:  # noqa: BLE001 (raised again by the caller, outside the kernel)
            self.error = e
            return 1

    def _raise(self, layer: int) -> None:
        error, self.error = self.error, None
        raise error or RuntimeError(f"decode_gqa_moe: layer {layer}'s experts failed")

    def __call__(self, x: torch.Tensor, pos: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """x [hidden] fp32 contiguous (the token's embedding; the residual stream, updated in place),
        cache position `pos`, RoPE tables [rot] at it -> the final-normed hidden state [hidden]."""
        h = torch.empty(self.hidden)
        failed = library().decode_gqa_moe(ctypes.addressof(self.layers), len(self.layers), x.data_ptr(), self.hidden,
                                          pos, cos.data_ptr(), signed_sin.data_ptr(), self.final_norm.data_ptr(),
                                          self.eps, int(self.q8), h.data_ptr(), self.delta.data_ptr(),
                                          self.ids.data_ptr(), self.weights.data_ptr(), self.attn_scratch.data_ptr(),
                                          self.moe_scratch.data_ptr(), self.callback, threads())
        if failed >= 0:
            self._raise(failed)
        return h

    def rows(self, x: torch.Tensor, seqs: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`decode_gqa_moe_rows`: N rows at once over their paged caches (as `DenseDecoder.rows`), each row with the
        bits `__call__` gives its token alone: x [N, hidden] (updated), seqs [L, N, 10], cos / signed_sin [N, rot]
        -> the final-normed hidden states [N, hidden]."""
        N, L = x.shape[0], len(self.layers)
        _check_rows(x, seqs, cos, signed_sin, self.hidden, L)
        if self.row_buffers is None or self.row_buffers[0] < N:  # grown to the largest batch seen
            slice_rows = min(N, self.moe_rows)
            top_k = self.ids.shape[0]
            self.row_buffers = (N, torch.empty(N * self.row_floats), torch.empty(N, self.hidden),
                                torch.empty(slice_rows * top_k, dtype=torch.int64), torch.empty(slice_rows * top_k),
                                torch.empty(self._moe_bytes(slice_rows), dtype=torch.uint8))
        _, work, delta, ids, weights, scratch = self.row_buffers
        h = torch.empty(N, self.hidden)
        bad = library().decode_gqa_moe_rows(
            ctypes.addressof(self.layers), L, N, x.data_ptr(), self.hidden, seqs.data_ptr(), cos.data_ptr(),
            signed_sin.data_ptr(), cos.stride(0), self.final_norm.data_ptr(), self.eps, int(self.q8), self.moe_rows,
            h.data_ptr(), delta.data_ptr(), work.data_ptr(), ids.data_ptr(), weights.data_ptr(), scratch.data_ptr(),
            self.callback, threads())
        if bad >= L * N:
            self._raise(bad - L * N)
        _check_position(bad, seqs, N)
        return h


def _floats(address: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


def _check_rows(x: torch.Tensor, seqs: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, hidden: int,
                L: int) -> None:
    N = x.shape[0]
    assert x.shape == (N, hidden) and x.dtype == torch.float32 and x.is_contiguous(), f"x {tuple(x.shape)}"
    assert seqs.shape == (L, N, 10) and seqs.dtype == torch.long and seqs.is_contiguous(), \
        f"seqs {tuple(seqs.shape)} against [{L}, {N}, 10]"
    assert cos.shape == signed_sin.shape and cos.shape[0] == N and cos.stride(-1) == signed_sin.stride(-1) == 1 \
        and cos.stride(0) == signed_sin.stride(0), f"RoPE tables {tuple(cos.shape)}, {tuple(signed_sin.shape)}"


def _check_position(bad: int, seqs: torch.Tensor, N: int) -> None:
    assert bad < 0, (f"layer {bad // N} row {bad % N}: position {int(seqs.view(-1, 10)[bad, 8])} lies past the "
                     f"cache's {int(seqs.view(-1, 10)[bad, 7])} positions")


class DenseDecoder(_Pools):
    """`decode_dense` bound to a model's layers. Each entry of `layers` is a dict with attn_norm and
    mlp_norm (fp32 [hidden]), sinks ([H] fp32 or None), q_norm and k_norm ([head_dim] fp32 or None),
    the attention's shape (heads, kv_heads, head_dim, rot, window, scale) and four matrices qkv, o,
    gate_up ([gate; up] rows), down, each a tuple (data tensor, type: MATRIX_TYPES value or
    GGML_MATRIX_TYPES, rows, cols, bias or None). The tensors are held here, so the pointers stay
    valid."""

    def __init__(self, layers: list[dict], hidden: int, final_norm: torch.Tensor, eps: float):
        self.held = [layers, final_norm]
        self.hidden, self.final_norm, self.eps = hidden, final_norm, eps
        self.layers = (DenseLayer * len(layers))()
        attn_floats = widest = mlp = 0
        for c, d in zip(self.layers, layers):
            c.attn_norm, c.mlp_norm, c.sinks = _ptr(d["attn_norm"]), _ptr(d["mlp_norm"]), _ptr(d["sinks"])
            c.q_norm, c.k_norm = _ptr(d["q_norm"]), _ptr(d["k_norm"])
            for name in ("heads", "kv_heads", "head_dim", "rot", "window"):
                setattr(c, name, int(d[name]))
            c.scale = d["scale"]
            for name in ("qkv", "o", "gate_up", "down"):
                data, kind, rows, cols, bias = d[name]
                setattr(c, name, Matrix(data.data_ptr(), kind, rows, cols, _ptr(bias)))
                widest = max(widest, cols)
            attn_floats = max(attn_floats, library().gqa_step_scratch(c.heads, c.kv_heads, c.head_dim))
            mlp = max(mlp, c.gate_up.rows)
        self.attn_scratch, self.mlp = torch.empty(attn_floats), torch.empty(mlp)
        self.xq = torch.empty(library().decode_dense_xq_bytes(widest), dtype=torch.uint8)
        self.delta = torch.empty(hidden)
        self.pools: list[tuple[int, int, int] | None] = [None] * len(layers)
        self.widest = widest
        self.row_floats = library().decode_dense_rows_work(ctypes.addressof(self.layers), len(self.layers))
        self.row_buffers: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, work, xq, delta

    def rows(self, x: torch.Tensor, seqs: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """`decode_dense_rows`: N sequences' tokens at once over their paged caches, each row with the bits
        `__call__` gives it alone. x [N, hidden] fp32 contiguous (the embedded tokens; updated), seqs [L, N, 10]
        int64 contiguous (each layer's kernels/gqa_decode `gqa_decode_rows` fields of the rows: engine/batch.py),
        cos / signed_sin [N, rot] (each row's RoPE tables, rows contiguous) -> the final-normed hidden states
        [N, hidden]."""
        N, L = x.shape[0], len(self.layers)
        _check_rows(x, seqs, cos, signed_sin, self.hidden, L)
        lib = library()
        if self.row_buffers is None or self.row_buffers[0] < N:  # grown to the largest batch seen
            self.row_buffers = (N, torch.empty(N * self.row_floats),
                                torch.empty(lib.decode_dense_rows_xq_bytes(N, self.widest), dtype=torch.uint8),
                                torch.empty(N, self.hidden))
        _, work, xq, delta = self.row_buffers
        h = torch.empty(N, self.hidden)
        bad = lib.decode_dense_rows(ctypes.addressof(self.layers), L, N, x.data_ptr(), self.hidden, seqs.data_ptr(),
                                    cos.data_ptr(), signed_sin.data_ptr(), cos.stride(0), self.final_norm.data_ptr(),
                                    self.eps, h.data_ptr(), delta.data_ptr(), work.data_ptr(), xq.data_ptr(), threads())
        _check_position(bad, seqs, N)
        return h

    def __call__(self, x: torch.Tensor, pos: int, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
        """As GqaMoeDecoder.__call__."""
        h = torch.empty(self.hidden)
        library().decode_dense(ctypes.addressof(self.layers), len(self.layers), x.data_ptr(), self.hidden, pos,
                               cos.data_ptr(), signed_sin.data_ptr(), self.final_norm.data_ptr(), self.eps,
                               h.data_ptr(), self.delta.data_ptr(), self.attn_scratch.data_ptr(), self.mlp.data_ptr(),
                               self.xq.data_ptr(), threads())
        return h


__all__ = ["GGML_MATRIX_TYPES", "MATRIX_TYPES", "STACKED", "X16", "DenseDecoder", "GqaMoeDecoder", "Layer", "Matrix", "available"]
