"""`decode_hybrid` (hybrid_cpu.cpp) bound to a model's layers: KDA, Gated DeltaNet, absorbed-MLA and GQA
mixers (MLA with DSA's lightning or k-pool indexer and its top-k, or a dsa_shared selection), dense or MoE MLPs
(latent projection, shared experts, a shared-expert gate), plain or attention residuals or hyper-connections, for
one decode token of one sequence in one call (Kimi K3, Kimi-Linear, Qwen3-Next, DeepSeek-V3 / V3.2, Kimi K2.5,
GLM-5, GLM-5-Next).

The kernel is the op-by-op engine step (engine/layers/: kda.py, gated_deltanet.py, mla.py, dsa.py, attention.py,
moe.py, attn_res.py, hyper_connections.py)
in fp32 C++; tests/kernels/test_decode_hybrid.py checks it against that path (the reference) within
1e-5 of the logit range and the AVX2 build against the AVX-512 one bit for bit. Routed experts run in
the kernel where a layer gives a resident MXFP4, dense or GGUF-block table, else through `experts(layer, h, x)` -> [W], called
back from the kernel (the engine routes h and dispatches x to its provider: a pager, bf16 experts).
"""

from __future__ import annotations

import ctypes

import torch
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.fp8_cache.cpu import CacheRows

from . import MATRIX_TYPES, Matrix

_p, _i, _f = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
NO_MATRIX = (None, 0, 0, 0, None)
MAX_HEAD_DIM, MAX_LATENT = 512, 1024  # hybrid_mixers.h stack buffers: KDA K, MLA kv_lora_rank (+ rope <= 128)
MAX_BLOCKS = 62  # attention-residual blocks per token (hybrid_cpu.cpp depth_mix scores)
MAX_TOP_K = 64  # routed experts per token of a layer with resident dense experts (hybrid_cpu.cpp mlp's order)


class Kda(ctypes.Structure):
    """hybrid_mixers.h `struct Kda`."""

    _fields_ = [("in_proj", Matrix), ("f_b", Matrix), ("g_b", Matrix), ("conv", _p), ("decay", _p), ("dt_bias", _p),
                ("o_norm", _p), ("state", _p), ("tail", _p), ("heads", _i), ("head_dim", _i), ("conv_kernel", _i),
                ("bounded", _i), ("lower_bound", _f), ("eps", _f)]


class Indexer(ctypes.Structure):
    """hybrid_mixers.h `struct Indexer` (select 0: none, 1: the layer's own indexer, 2: dsa_shared)."""

    _fields_ = [("wq_b", Matrix), ("wk", Matrix), ("weights", Matrix), ("gate", Matrix), ("k_norm_w", _p),
                ("k_norm_b", _p), ("ape", _p), ("keys", CacheRows), ("select", _i), ("heads", _i), ("head_dim", _i),
                ("rope_dim", _i), ("interleaved", _i), ("top_k", _i), ("pool", _i), ("tail", _i),
                ("dense_context", _i), ("weight_scale", _f), ("pooled", _p), ("pooled_done", _p)]


class Mla(ctypes.Structure):
    """hybrid_mixers.h `struct Mla`."""

    _fields_ = [("q_a", Matrix), ("q_b", Matrix), ("kv_a", Matrix), ("g", Matrix), ("q_a_norm", _p),
                ("kv_a_norm", _p), ("w_uk", _p), ("w_uv", _p), ("rows", CacheRows), ("heads", _i), ("kv_rank", _i),
                ("nope", _i), ("rope", _i), ("vdim", _i), ("rotate", _i), ("scale", _f), ("eps", _f),
                ("dsa", Indexer)]


class Gdn(ctypes.Structure):
    """hybrid_mixers.h `struct Gdn`."""

    _fields_ = [("in_proj", Matrix), ("conv", _p), ("decay", _p), ("dt_bias", _p), ("norm", _p), ("state", _p),
                ("tail", _p), ("key_heads", _i), ("value_heads", _i), ("key_dim", _i), ("value_dim", _i),
                ("conv_kernel", _i), ("eps", _f)]


class Gqa(ctypes.Structure):
    """hybrid_cpu.cpp `struct Gqa`."""

    _fields_ = [("qkv", Matrix), ("gate", Matrix), ("q_norm", _p), ("k_norm", _p), ("sinks", _p), ("kpool", _p),
                ("vpool", _p), ("heads", _i), ("kv_heads", _i), ("head_dim", _i), ("rot", _i), ("head_stride", _i),
                ("window", _i), ("scale", _f), ("eps", _f), ("keys", CacheRows), ("values", CacheRows)]


MIXERS = ("kda", "mla", "gdn", "gqa")  # hybrid_cpu.cpp HybridLayer.mixer


class HybridLayer(ctypes.Structure):
    """hybrid_cpu.cpp `struct HybridLayer`."""

    _fields_ = [("attn_norm", _p), ("mlp_norm", _p), ("attn_query", _p), ("mlp_query", _p), ("mixer", _i),
                ("kda", Kda), ("mla", Mla), ("gdn", Gdn), ("gqa", Gqa), ("o_proj", Matrix), ("moe", _i),
                ("gate_up", Matrix), ("down", Matrix), ("glu", _i), ("glu_p0", _f), ("glu_p1", _f),
                ("shared_gate", _p), ("lat_down", Matrix), ("lat_up", Matrix),
                ("lat_norm", _p), ("lat_eps", _f), ("router_w", _p), ("router_b", _p), ("correction", _p),
                ("table", _p), ("dense", _p), ("scoring", _i), ("renormalize", _i), ("experts", _i),
                ("intermediate", _i), ("top_k", _i), ("expert_glu", _i), ("dense_type", _i), ("scaling", _f),
                ("p0", _f), ("p1", _f), ("blocks", _p), ("block_types", _i * 3), ("hc_attn", Matrix),
                ("hc_ffn", Matrix), ("hc_attn_base", _p), ("hc_attn_scale", _p), ("hc_ffn_base", _p),
                ("hc_ffn_scale", _p), ("hc_mult", _i), ("hc_iters", _i), ("hc_eps", _f)]


ExpertsFn = ctypes.CFUNCTYPE(ctypes.c_int, _i, _i, _p, _p, _p)  # (layer, rows, h, x, out)


class HybridCall(ctypes.Structure):
    """hybrid_cpu.cpp `struct HybridCall`: a call's arguments, built once; x, pos, the RoPE tables, h, logits and
    threads are set before each call."""

    _fields_ = [("layers", _p), ("n", _i), ("x", _p), ("D", _i), ("pos", _i), ("cos", _p), ("ssin", _p),
                ("block_size", _i), ("output_query", _p), ("final_norm", _p), ("eps", _f), ("q8", _i), ("h", _p),
                ("head", _p), ("logits", _p), ("ids", _p), ("weights", _p), ("scratch", _p), ("moe_scratch", _p),
                ("xq", _p), ("experts", ExpertsFn), ("threads", _i)]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _matrix(m: tuple) -> Matrix:
    data, kind, rows, cols, bias = m
    return Matrix(_ptr(data), kind, rows, cols, _ptr(bias))


def dense_expert(x: torch.Tensor, parts: tuple, glu: tuple, weight: float, out: torch.Tensor,
                 scratch: torch.Tensor, xq: torch.Tensor) -> None:
    """out [W] += weight * down(glu(gate x, up x)) for one token x [D] fp32 and one expert whose gate, up, down
    are (data, type, rows, cols, bias) Matrix tuples; `scratch` >= 2 I + W floats, `xq` the matvec scratch
    for the widest input (`xq_bytes`)."""
    gate, up, down = (_matrix(m) for m in parts)
    library().dense_expert(x.data_ptr(), ctypes.byref(gate), ctypes.byref(up), ctypes.byref(down), glu[0], glu[1],
                           glu[2], weight, out.data_ptr(), scratch.data_ptr(), xq.data_ptr(), threads())


def dense_experts_token(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, table, glu: tuple, out: torch.Tensor,
                        scratch: torch.Tensor, xq: torch.Tensor) -> None:
    """out [W] += one token x [W]'s routed experts ids (int64 [k], added in that order) with weights (fp32 [k]),
    from `table`'s dense matrices (addresses int64 [E, 3] of gate, up, down; dtype, intermediate, hidden: a
    DenseExpertTable or kernels/mxfp4_moe/held.py HeldDenseTable): the loop the step runs over a resident layer's
    dense experts, one `dense_expert` each. `scratch` >= 2 I + W floats, `xq` the matvec scratch (`xq_bytes`)."""
    library().dense_experts_token(x.data_ptr(), table.hidden, table.intermediate, ids.data_ptr(), weights.data_ptr(),
                                  ids.shape[0], table.addresses.data_ptr(), MATRIX_TYPES[table.dtype], glu[0], glu[1],
                                  glu[2], out.data_ptr(), scratch.data_ptr(), xq.data_ptr(), threads())


def xq_bytes(cols: int) -> int:
    """Bytes of matvec scratch for inputs of up to `cols` values."""
    return library().decode_dense_xq_bytes(cols)


def _view(address: int, n: int) -> torch.Tensor:
    return torch.frombuffer((ctypes.c_float * n).from_address(address), dtype=torch.float32)


class HybridDecoder:
    """The model's layers as a ctypes array, built once. Each entry of `layers` is a dict:
    attn_norm, mlp_norm ([D] fp32), attn_query / mlp_query ([D] or None), mixer (one of MIXERS) with its
    dict under that key (matrices as (data, type, rows, cols, bias) tuples of decode_layers.Matrix, fp32
    vectors: the fields of the struct of that name), o_proj; moe (bool), gate_up / down (dense MLP or
    shared experts, or None), glu (glu.h kind, p0, p1), shared_gate ([D] or None); hyper-connections (GLM-5-Next): hc_attn / hc_ffn (fn Matrix tuples), hc_attn_base,
    hc_attn_scale, hc_ffn_base, hc_ffn_scale, hc (streams, Sinkhorn rounds, eps), or absent; for a MoE: lat_down / lat_up / lat_norm / lat_eps (or None),
    router_w / router_b / correction, table (ExpertTable.addresses or None), dense (DenseExpertTable.addresses
    or None; with dense_type, its MATRIX_TYPES value), blocks (ggml_gemv BlockExpertTable.addresses or None; with
    block_types, the gate / up / down GGML types; no table: the callback), scoring,
    renormalize, experts, intermediate, top_k, expert_glu (kind, p0, p1), scaling. `experts(index, h, x)`
    returns layer `index`'s routed-expert sum [W] for a layer without a table. `head`: the lm_head as a Matrix
    tuple, computed in the same call (the call then gives logits), or None. The caller sets each layer's cache
    pointers before a call (`set_state`, `set_rows`, `set_pools`)."""

    def __init__(self, layers: list[dict], hidden: int, final_norm: torch.Tensor, eps: float, q8: bool,
                 block_size: int, output_query: torch.Tensor | None, experts=None, head: tuple | None = None):
        self.held = [layers, final_norm, output_query, head]
        self.hidden, self.final_norm, self.eps, self.q8 = hidden, final_norm, eps, q8
        self.block_size, self.output_query = block_size, output_query
        self.layers = (HybridLayer * len(layers))()
        top_k = moe_bytes = widest = 0
        lib = library()
        for c, d in zip(self.layers, layers):
            for name in ("attn_norm", "mlp_norm", "attn_query", "mlp_query", "lat_norm", "router_w", "router_b",
                         "correction", "table", "dense", "blocks", "shared_gate", "hc_attn_base", "hc_attn_scale",
                         "hc_ffn_base", "hc_ffn_scale"):
                setattr(c, name, _ptr(d.get(name)))
            c.mixer = MIXERS.index(d["mixer"])
            self._fill(getattr(c, d["mixer"]), d[d["mixer"]])
            c.o_proj = _matrix(d["o_proj"])
            c.moe = int(d["moe"])
            for name in ("gate_up", "down", "lat_down", "lat_up", "hc_attn", "hc_ffn"):
                setattr(c, name, _matrix(d.get(name) or NO_MATRIX))
            c.hc_mult, c.hc_iters, c.hc_eps = d.get("hc", (0, 0, 0.0))
            c.glu, c.glu_p0, c.glu_p1 = d.get("glu", (0, 0.0, 0.0))
            widest = max(widest, *(m[3] for m in self._matrices(d)))
            if c.moe:
                c.lat_eps = d.get("lat_eps", 0.0)
                for name in ("scoring", "renormalize", "experts", "intermediate", "top_k"):
                    setattr(c, name, int(d[name]))
                c.expert_glu, c.p0, c.p1 = d["expert_glu"]
                c.scaling = d["scaling"]
                top_k = max(top_k, c.top_k)
                width = c.lat_down.rows or hidden
                if c.table:
                    moe_bytes = max(moe_bytes, lib.mxfp4_moe_routed_scratch(1, c.top_k, width, c.intermediate,
                                                                            c.experts))
                if c.dense:  # router logits [E], then dense_expert's 2 I + W floats
                    c.dense_type = d["dense_type"]
                    moe_bytes = max(moe_bytes, 4 * (c.experts + 2 * c.intermediate + width))
                    widest = max(widest, c.intermediate)
                if c.blocks:  # router logits [E], then ggml_moe_token's scratch
                    c.block_types[:] = d["block_types"]
                    moe_bytes = max(moe_bytes, 4 * c.experts + 64 +
                                    lib.ggml_moe_token_scratch(c.top_k, width, c.intermediate))
        self.head = None if head is None else _matrix(head)
        self.vocab = 0 if head is None else head[2]
        if head is not None:
            widest = max(widest, head[3])
        floats = lib.decode_hybrid_scratch(ctypes.addressof(self.layers), len(layers), hidden, block_size)
        self.scratch = torch.empty(floats)
        self.moe_scratch = torch.empty(max(moe_bytes, 64), dtype=torch.uint8)
        self.xq = torch.empty(lib.decode_dense_xq_bytes(widest), dtype=torch.uint8)
        self.ids, self.weights = torch.empty(max(top_k, 1), dtype=torch.int64), torch.empty(max(top_k, 1))
        self.widths = [c.lat_down.rows or hidden for c in self.layers]
        self.experts, self.error = experts, None
        self._views: dict[tuple, tuple[torch.Tensor, ...]] = {}  # the callback's (h, x, out) views by address
        self.callback = ExpertsFn(self._experts)
        self.h = torch.empty(hidden)  # the final hidden state where the call gives logits
        self.stream = torch.empty(hidden)  # the residual stream of a call given an embedding row's address
        self.x = self.stream.data_ptr()
        self.widest = widest
        # the call's arguments, converted once (a decode token's Python runs on cold caches): a token sets five
        self.call = HybridCall(
            ctypes.addressof(self.layers), len(self.layers), 0, hidden, 0, None, None, block_size, _ptr(output_query),
            final_norm.data_ptr(), eps, int(q8), self.h.data_ptr(),
            None if self.head is None else ctypes.addressof(self.head), None,
            *(t.data_ptr() for t in (self.ids, self.weights, self.scratch, self.moe_scratch, self.xq)), self.callback,
            threads())
        self.call_ref = ctypes.byref(self.call)
        self.row_call: HybridCall | None = None  # the rows' call (its xq grown to the most rows seen)
        self.row_xq = torch.empty(0, dtype=torch.uint8)

    @staticmethod
    def _matrices(d: dict) -> list[tuple]:
        mixer = d[d["mixer"]]
        ms = [d["o_proj"], *(d.get(n) for n in ("gate_up", "down", "lat_down", "lat_up", "hc_attn", "hc_ffn"))]
        ms += [mixer.get(n) for n in ("in_proj", "f_b", "g_b", "q_a", "q_b", "kv_a", "g", "qkv", "gate")]
        ms += [mixer.get("dsa", {}).get(n) for n in ("wq_b", "wk", "weights", "gate")]
        return [m for m in ms if m is not None]

    @staticmethod
    def _fill(c: ctypes.Structure, d: dict) -> None:
        """A mixer struct from its dict: Matrix fields from tuples (absent: none), pointers from tensors, numbers."""
        for name, kind in c._fields_:
            value = d.get(name)
            if kind is Matrix:
                setattr(c, name, _matrix(value or NO_MATRIX))
            elif kind is Indexer:
                HybridDecoder._fill(getattr(c, name), value or {})
            elif kind is CacheRows:
                continue  # the caller's, before each call (`set_rows`, `set_index`)
            elif kind is _p:
                setattr(c, name, _ptr(value))
            elif value is not None:
                setattr(c, name, float(value) if kind is _f else int(value))

    def row_set(self, like=None):
        """A copy of the layers (or of `like`, another such copy) for a sequence's caches in `rows`: the set_* methods
        bind it when given it as `layers`."""
        like = self.layers if like is None else like
        return type(like).from_buffer_copy(like)

    def set_state(self, i: int, state: torch.Tensor, tail: torch.Tensor, layers=None) -> None:
        """Layer i's recurrent state [1, H, K, V] and conv tail [1, W-1, C], fp32 contiguous (updated in place)."""
        layer = (self.layers if layers is None else layers)[i]
        mixer = getattr(layer, MIXERS[layer.mixer])
        mixer.state, mixer.tail = state.data_ptr(), tail.data_ptr()

    def set_pools(self, i: int, keys: torch.Tensor, values: torch.Tensor, layers=None) -> None:
        """Layer i's (GQA) K/V pools [1, Hkv, capacity, D] fp32 (written in place)."""
        gqa = (self.layers if layers is None else layers)[i].gqa
        gqa.kpool, gqa.vpool, gqa.head_stride = keys.data_ptr(), values.data_ptr(), keys.stride(1)
        gqa.keys, gqa.values = CacheRows(), CacheRows()

    def set_kv_rows(self, i: int, keys: CacheRows, values: CacheRows, layers=None) -> None:
        """Layer i's (GQA) K/V caches in their own dtype (kernels/fp8_cache `cache_rows`: Hkv heads of head_dim
        values; bf16 / fp8, the token's rows written as the engine writes them)."""
        gqa = (self.layers if layers is None else layers)[i].gqa
        if not keys.heads == values.heads == gqa.kv_heads or not keys.dim == values.dim == gqa.head_dim:
            raise ValueError(f"layer {i}: K/V caches of {keys.heads} x {keys.dim} values, not the layer's "
                             f"{gqa.kv_heads} x {gqa.head_dim}")
        gqa.keys, gqa.values = keys, values

    def set_rows(self, i: int, rows: CacheRows, layers=None) -> None:
        """Layer i's latent cache (kernels/fp8_cache `cache_rows`: one head of r + rope values; the token's row is
        written)."""
        (self.layers if layers is None else layers)[i].mla.rows = rows

    def set_index(self, i: int, keys: CacheRows, pooled: torch.Tensor | None = None,
                  done: torch.Tensor | None = None, layers=None) -> None:
        """Layer i's (DSA) index-key cache (heads: its blocks; the token's key is written); a k-pool layer's kept
        pool keys [>= the complete pools, Di] fp32 and their count [1] int64 (the kernel adds the new ones)."""
        dsa = (self.layers if layers is None else layers)[i].mla.dsa
        if keys.heads * keys.dim != dsa.head_dim * (2 if dsa.gate.rows else 1):
            raise ValueError(f"layer {i}: the index cache holds {keys.heads} x {keys.dim} values per token, not "
                             f"the indexer's key{' and gate logits' if dsa.gate.rows else ''} ({dsa.head_dim} each)")
        dsa.keys, dsa.pooled, dsa.pooled_done = keys, _ptr(pooled), _ptr(done)

    def _experts(self, index: int, n: int, h: int, x: int, out: int) -> int:
        try:
            key = (h, x, out, index, n)
            views = self._views.get(key)
            if views is None:  # the kernel passes its scratch: the same few addresses every token
                if len(self._views) > 4096:
                    self._views.clear()
                width = self.widths[index]
                views = self._views[key] = (_view(h, n * self.hidden).view(n, -1), _view(x, n * width).view(n, -1),
                                            _view(out, n * width))
            y = self.experts(index, views[0], views[1])
            views[2].copy_(y.view(-1))
            return 0
        except BaseException as e:  # noqa: BLE001 (raised again by __call__, outside the kernel)
            self.error = e
            return 1

    def _raise(self) -> None:
        error, self.error = self.error, None
        raise error or RuntimeError("decode_hybrid: ggml_moe_token refused a layer's block experts")

    def __call__(self, x: torch.Tensor | int, pos: int, cos: torch.Tensor | None = None,
                 signed_sin: torch.Tensor | None = None) -> torch.Tensor:
        """x [hidden] fp32 contiguous (the token's embedding; overwritten), or the address of such a row (copied
        first, not written), cache position `pos`, the RoPE tables [rot] at its rotary position for GQA and
        rotating MLA layers -> the logits [vocab] where the decoder has a head, else the final-normed hidden
        state [hidden]."""
        out = torch.empty(self.vocab or self.hidden)
        call = self.call
        if self.vocab:
            call.logits = out.data_ptr()
        else:
            call.h = out.data_ptr()
        call.x = ctypes.memmove(self.x, x, 4 * self.hidden) if type(x) is int else x.data_ptr()
        call.pos, call.threads = pos, threads()
        call.cos = None if cos is None else cos.data_ptr()
        call.ssin = None if signed_sin is None else signed_sin.data_ptr()
        if library().decode_hybrid(self.call_ref):
            self._raise()
        return out

    def rows(self, x: torch.Tensor, sets: list, pos: list[int], cos: torch.Tensor | None,
             signed_sin: torch.Tensor | None, carry: list[int] | None, slice_rows: int) -> torch.Tensor:
        """`decode_hybrid_rows`: N rows in one call, each with the bits `__call__` gives its token alone (the layers'
        mixers row by row in row order, every matrix, norm and routed expert over all rows): x [N, hidden] fp32
        contiguous (updated), sets[n]: row n's layers (this decoder's `layers`, or a `row_set` bound to its caches;
        the rows of one sequence share one), pos [N] the rows' cache positions, cos / signed_sin [N, rot] their RoPE
        tables (or None), carry[n]: the row whose delta-rule states row n starts from (its own states: a verify
        that keeps each row's, engine/state_cache.py `record`), -1 or None for none; slice_rows: the most rows of
        one resident MXFP4 MoE call (kernels/mxfp4_moe EXACT_TOKEN_ROWS) -> the final-normed hidden states
        [N, hidden] (no head)."""
        N = x.shape[0]
        assert x.shape == (N, self.hidden) and x.dtype == torch.float32 and x.is_contiguous(), f"x {tuple(x.shape)}"
        lib = library()
        if self.row_call is None or self.row_xq.numel() < lib.decode_dense_rows_xq_bytes(N, self.widest):
            self.row_xq = torch.empty(lib.decode_dense_rows_xq_bytes(N, self.widest), dtype=torch.uint8)
            self.row_call = HybridCall.from_buffer_copy(self.call)
            self.row_call.xq, self.row_call.head, self.row_call.logits = self.row_xq.data_ptr(), None, None
        call = self.row_call
        h = torch.empty(N, self.hidden)
        call.x, call.h, call.threads = x.data_ptr(), h.data_ptr(), threads()
        if cos is not None:
            assert cos.shape == signed_sin.shape and cos.shape[0] == N and cos.stride(-1) == 1 and \
                cos.stride(0) == signed_sin.stride(0), f"RoPE tables {tuple(cos.shape)}"
        call.cos = None if cos is None else cos.data_ptr()
        call.ssin = None if signed_sin is None else signed_sin.data_ptr()
        addresses = torch.tensor([ctypes.addressof(s) for s in sets], dtype=torch.int64)
        positions = torch.tensor(pos, dtype=torch.int64)
        carried = None if carry is None else torch.tensor(carry, dtype=torch.int64)
        if lib.decode_hybrid_rows(ctypes.byref(call), addresses.data_ptr(), N, positions.data_ptr(),
                                  0 if cos is None else cos.stride(0),
                                  None if carried is None else carried.data_ptr(), slice_rows):
            self._raise()
        return h
