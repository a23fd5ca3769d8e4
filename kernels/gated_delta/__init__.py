"""Gated DeltaNet dispatcher. CUDA: flash-linear-attention's kernels where fla-core imports
(kernels/kda/fla_ops.py), else our Triton; on the CPU the C++ token loop (kernels/kda/native.py, one decay per head)
where the CPU library is built, else KDA's vectorised CPU forms with the per-head decay repeated over the key
channels (Gated DeltaNet is KDA with one decay per head). `gdn_chunk` (kernels/kda/native.py): a whole Gated DeltaNet
mixer between its projections in one C++ call, where `mixer_available` (the engine's CPU path)."""

from __future__ import annotations

from localmoe.kernels._triton import usable
from localmoe.kernels.gated_delta.reference import naive_recurrent_gated_delta
from localmoe.kernels.kda import cpu as kda_cpu
from localmoe.kernels.kda import fla_ops, native

RECURRENT_MAX_T = 8


def gated_delta(q, k, v, g, beta, state):
    """q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]; state: [B, H, K, V] -> (o, state) fp32."""
    recurrent = q.shape[1] <= RECURRENT_MAX_T
    if usable(q):
        if fla_ops.ops() is not None:
            op = "fused_recurrent_gated_delta_rule" if recurrent else "chunk_gated_delta_rule"
            return fla_ops.run(op, q, k, v, g, beta, state)
        from localmoe.kernels.gated_delta import triton as tk

        fn = tk.fused_recurrent_gated_delta if recurrent else tk.chunk_gated_delta
        return fn(q, k, v, g, beta, state)
    if native.available(q, v):
        return native.delta_rule(q, k, v, g, beta, state, scalar_decay=True)
    per_channel = g.unsqueeze(-1).expand(*g.shape, q.shape[-1])  # [B, T, H, K]: the same decay for every channel
    fn = kda_cpu.recurrent_kda if recurrent else kda_cpu.chunk_kda
    return fn(q, k, v, per_channel, beta, state)


gdn_chunk = native.gdn_chunk  # a Gated DeltaNet layer's prompt chunk between its projections, where `mixer_available`
mixer_available = native.mixer_available

__all__ = ["gated_delta", "gdn_chunk", "mixer_available", "naive_recurrent_gated_delta"]
