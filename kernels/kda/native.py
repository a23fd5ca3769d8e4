"""The delta rule on CPU tensors through the localmoe CPU library (kernels/_cpu): each (batch row, head) runs its
tokens in order through the fused decode step's one-token update (`delta_rule_tokens`, kernels/decode_layers:
hybrid_mixers.h `delta_heads`), its fp32 state [K, V] held in L1 / L2 over the whole call. KDA (a log-decay per
channel) and Gated DeltaNet (one per head) share it.

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
