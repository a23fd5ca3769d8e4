"""The delta rule on CPU tensors through the localmoe CPU library (kernels/_cpu): each (batch row, head) runs its
tokens in order through the fused decode step's one-token update (`delta_rule_tokens`, kernels/decode_layers:
hybrid_mixers.h `delta_heads`), its fp32 state [K, V] held in L1 / L2 over the whole call. KDA (a log-decay per
channel) and Gated DeltaNet (one per head) share it. `kda_chunk` / `gdn_chunk` run a whole mixer's chunk between its
projections in one call (kernels/decode_layers/hybrid_prefill.cpp: conv + SiLU, l2norm, gates, the delta rule, the
output norm * gate, each token with the fused decode step's arithmetic): the engine's prefill path on the CPU.

The recurrent form in C++ costs O(T H K V) with no per-chunk torch ops: for a 72-token prompt chunk of a `small`
model (8 heads, K = V = 64) ~0.3 ms a layer against ~3 ms for the vectorised torch chunk form (cpu.py, dozens of
small ops per chunk); every token gets the bits the fused decode step gives it.
"""

from __future__ import annotations

import torch
from localmoe.kernels._cpu import library, threads

MAX_DIM = 512  # K, V: the one-token update's stack buffers


def available(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `delta_rule` can run these tensors: CPU, K and V within MAX_DIM, the library built."""
    return (q.device.type == "cpu" and q.shape[-1] <= MAX_DIM and v.shape[-1] <= MAX_DIM
            and library() is not None)


def mixer_available(x: torch.Tensor, *dims: int) -> bool:
    """Whether the C++ prefill mixers (`kda_chunk`, `gdn_chunk`) run a chunk x of a layer with head dims `dims`: a CPU
    tensor, every dim within MAX_DIM, the library built."""
    return x.device.type == "cpu" and max(dims) <= MAX_DIM and library() is not None


def delta_rule(q, k, v, g, beta, state, scalar_decay: bool):
    """q, k: [B, T, H, K] (q normalised and scaled, k normalised); v: [B, T, H, V]; g: [B, T, H, K] (KDA) or [B, T, H]
    (scalar_decay: Gated DeltaNet); beta: [B, T, H]; state: [B, H, K, V] (not modified) -> (o [B, T, H, V], the final
    state [B, H, K, V]), fp32."""
    q, k, v, g, beta = (t.float().contiguous() for t in (q, k, v, g, beta))
    B, T, H, K = q.shape
    V = v.shape[-1]
    assert tuple(k.shape) == (B, T, H, K) and tuple(v.shape) == (B, T, H, V), "q, k [B, T, H, K]; v [B, T, H, V]"
    assert tuple(g.shape) == ((B, T, H) if scalar_decay else (B, T, H, K)) and tuple(beta.shape) == (B, T, H)
    assert tuple(state.shape) == (B, H, K, V) and K <= MAX_DIM and V <= MAX_DIM
    S = state.float().contiguous().clone()
    o = v.new_empty(B, T, H, V)
    library().delta_rule_tokens(q.data_ptr(), k.data_ptr(), v.data_ptr(), g.data_ptr(), beta.data_ptr(), S.data_ptr(),
                                B, T, H, K, V, int(scalar_decay), o.data_ptr(), threads())
    return o, S


def _prepared(state: torch.Tensor, tail: torch.Tensor, valid: torch.Tensor | None, in_place: bool):
    """What a chunk call reads and advances: (state, tail) as fp32 contiguous copies, or the tensors themselves where
    `in_place` (a cache that no snapshot shares them with: not recording) and they already are; valid as fp32 [B, T]
    (1 / 0) or None."""
    if not (in_place and state.dtype == tail.dtype == torch.float32 and state.is_contiguous() and tail.is_contiguous()):
        state = state.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
        tail = tail.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return state, tail, None if valid is None else valid.float().contiguous()


def kda_chunk(y, f, gate, valid, state, tail, conv, decay, dt_bias, o_norm, bounded: bool, lower_bound: float,
              eps: float, in_place: bool = False):
    """One KDA layer's prompt chunk between its projections (hybrid_prefill.cpp `kda_chunk`; the fused decode step's
    arithmetic per token). y [B, T, R] in_proj's output (q k v | f_a | b | gate), contiguous, fp32: its q k v are
    overwritten; f [B, T, H, K] f_b's output (overwritten); gate [B, T, *] (row stride its own, last dim contiguous)
    the sigmoid gate's input [H K]; valid [B, T] or None; state [B, H, K, K], tail [B, W-1, 3 H K] (not modified);
    conv [3 H K, W], decay [H] (exp(A_log)), dt_bias [H K], o_norm [K] fp32 -> (o [B, T, H K], state, tail);
    `in_place`: state and tail advanced where they are (`_prepared`)."""
    B, T, R = y.shape
    H, K = state.shape[1], state.shape[2]
    W = conv.shape[1]
    assert y.is_contiguous() and y.dtype == torch.float32 and f.is_contiguous() and f.numel() == B * T * H * K
    assert gate.stride(-1) == 1 and gate.stride(0) == T * gate.stride(1) and K <= MAX_DIM and 2 <= W <= 17
    S, tail, v = _prepared(state, tail, valid, in_place)
    o = y.new_empty(B, T, H * K)
    library().kda_chunk(y.data_ptr(), R, f.data_ptr(), gate.data_ptr(), gate.stride(1), v.data_ptr() if v is not None
                        else None, B, T, conv.data_ptr(), decay.data_ptr(), dt_bias.data_ptr(), o_norm.data_ptr(),
                        S.data_ptr(), tail.data_ptr(), H, K, W, int(bounded), lower_bound, eps, o.data_ptr(), threads())
    return o, S, tail


def gdn_chunk(y, valid, state, tail, conv, decay, dt_bias, norm, key_heads: int, eps: float, in_place: bool = False):
    """One Gated DeltaNet layer's prompt chunk between its projections (hybrid_prefill.cpp `gdn_chunk`; the fused
    decode step's arithmetic per token, value head h on key head h // (Hv / Hk), no repeated q / k). y [B, T, R]
    in_proj's output (q k v | z | b | a), contiguous, fp32: its q k v are overwritten; valid [B, T] or None;
    state [B, Hv, K, V], tail [B, W-1, C] (not modified); conv [C, W], decay [Hv] (exp(A_log)), dt_bias [Hv],
    norm [V] fp32 -> (o [B, T, Hv V], state, tail); `in_place` as `kda_chunk`'s."""
    B, T, R = y.shape
    Hv, K, V = state.shape[1:]
    W = conv.shape[1]
    assert y.is_contiguous() and y.dtype == torch.float32 and K <= MAX_DIM and V <= MAX_DIM and 2 <= W <= 17
    S, tail, v = _prepared(state, tail, valid, in_place)
    o = y.new_empty(B, T, Hv * V)
    library().gdn_chunk(y.data_ptr(), R, v.data_ptr() if v is not None else None, B, T, conv.data_ptr(),
                        decay.data_ptr(), dt_bias.data_ptr(), norm.data_ptr(), S.data_ptr(), tail.data_ptr(), key_heads,
                        Hv, K, V, W, eps, o.data_ptr(), threads())
    return o, S, tail
