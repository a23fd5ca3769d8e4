"""KDA dispatcher. CUDA: flash-linear-attention's kernels where fla-core imports (fla_ops.py), else our
Triton, the recurrent form for a few tokens (decode), the chunked one for prefill. On the CPU: the C++ token loop
(native.py, the fused decode step's update) at every length where the CPU library is built, else the vectorised
PyTorch forms of cpu.py. `kda_chunk` (native.py): a whole KDA mixer between its projections in one C++ call, where
`mixer_available` (the engine's CPU path)."""

from __future__ import annotations

from localmoe.kernels._triton import usable
from localmoe.kernels.kda import cpu, fla_ops, native
from localmoe.kernels.kda.reference import naive_recurrent_kda

RECURRENT_MAX_T = 8  # calls of at most this many tokens use the recurrent kernel


def recurrent_kda(q, k, v, g, beta, state):
    """q, k, g: [B, T, H, K]; v: [B, T, H, V]; beta: [B, T, H]; state: [B, H, K, V] -> (o, state) fp32."""
    if usable(q):
        if fla_ops.ops() is not None:
            return fla_ops.run("fused_recurrent_kda", q, k, v, g, beta, state)
        from localmoe.kernels.kda.triton import fused_recurrent_kda

        return fused_recurrent_kda(q, k, v, g, beta, state)
    return cpu.recurrent_kda(q, k, v, g, beta, state)


def chunk_kda(q, k, v, g, beta, state, lower_bound: float | None = None):
    """The chunked form (prefill). Same contract as `recurrent_kda`; `lower_bound`: g is known to lie in
    [lower_bound, 0) (K3's bounded gate), which lets fla take its bounded-gate path."""
    if usable(q):
        if fla_ops.ops() is not None:
            return fla_ops.run("chunk_kda", q, k, v, g, beta, state, lower_bound)
        from localmoe.kernels.kda import triton as tk

        return tk.chunk_kda(q, k, v, g, beta, state)
    return cpu.chunk_kda(q, k, v, g, beta, state)


def kda(q, k, v, g, beta, state, lower_bound: float | None = None):
    """On the CPU the C++ token loop (native.py) where it runs; else recurrent for T <= RECURRENT_MAX_T, chunked
    above."""
    if not usable(q) and native.available(q, v):
        return native.delta_rule(q, k, v, g, beta, state, scalar_decay=False)
    if q.shape[1] <= RECURRENT_MAX_T:
        return recurrent_kda(q, k, v, g, beta, state)
    return chunk_kda(q, k, v, g, beta, state, lower_bound)


kda_chunk = native.kda_chunk  # a KDA layer's prompt chunk between its projections, where `mixer_available`
mixer_available = native.mixer_available

__all__ = ["chunk_kda", "kda", "kda_chunk", "mixer_available", "naive_recurrent_kda", "recurrent_kda"]
