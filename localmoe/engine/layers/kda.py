"""Kimi Delta Attention (KDA): a gated delta rule with a per-channel decay (Kimi-Linear, Kimi K3).

Per head, with an fp32 state S [K, V] and log-decay g [K] (g <= 0):
    S <- diag(exp(g)) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q
q and k are L2-normalised (eps 1e-6) after a depthwise causal conv + SiLU, and q is scaled
by K^-0.5. Two decay gates exist, chosen by the model family (never by which tensors exist):
    Kimi-Linear: g = -exp(A_log[h]) * softplus(f_b(f_a(x)) + dt_bias)
    Kimi K3:     g = lower_bound * sigmoid(exp(A_log[h]) * (f_b(f_a(x)) + dt_bias)), lower_bound -5
Output: o_proj(RMSNorm_head(o) * sigmoid(gate)), gate = g_b(g_a(x)) (Kimi-Linear) or g_proj(x) (K3).

The delta rule itself runs through the `localmoe.kernels.kda` dispatcher: Triton on GPU
tensors, on CPU the vectorised forms of kernels/kda/cpu.py (`recurrent_kda` for decode,
`chunk_kda` for prefill; re-exported here). Where the CPU kernel library runs, everything
between the projections (conv, SiLU, l2norm, gates, delta rule, output norm * gate) is one
C++ call per layer instead (`kda_chunk`: the fused decode step's arithmetic per token).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device
from localmoe.engine.linear import Linear, make_linear
from localmoe.engine.state_cache import DeltaStateCache
from localmoe.engine.step import Step
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.kernels.kda import kda, kda_chunk, mixer_available
from localmoe.kernels.kda.cpu import chunk_kda, recurrent_kda  # re-exported (__all__)

# What each family's KDA is; the decay/output gate kind is a family fact, not inferred from tensors.
KDA_VARIANTS = {
    "kimi_linear": {"bounded_gate": False, "full_rank_gate": False},
    "kimi_k3": {"bounded_gate": True, "full_rank_gate": True},
}


@dataclass(frozen=True, slots=True)
class Config:
    """KDA dimensions and variant flags (ModelSpec.kda)."""

    num_heads: int  # H
    head_dim: int  # K (= V)
    conv_kernel: int = 4
    bounded_gate: bool = False  # K3's lower_bound * sigmoid(...) decay instead of -exp(A) * softplus(...)
    gate_lower_bound: float = -5.0
    full_rank_gate: bool = False  # K3's g_proj instead of the low-rank g_b(g_a(x))
    norm_eps: float = 1e-6  # o_norm epsilon (the model's rms_norm_eps)
    hidden_size: int = 0  # D, the model's

    @classmethod
    def from_hf(cls, config: dict[str, Any], family: str) -> Config:
        """From a Kimi-Linear-style text config (`linear_attn_config` sub-dict) and the family name."""
        if family not in KDA_VARIANTS:
            raise LocalMoEError(f"KDA: no variant known for family {family!r} ({', '.join(KDA_VARIANTS)})")
        linear = config.get("linear_attn_config") or {}
        return cls(num_heads=linear["num_heads"], head_dim=linear["head_dim"],
                   conv_kernel=linear.get("short_conv_kernel_size", 4),
                   gate_lower_bound=float(linear.get("gate_lower_bound", -5.0)),
                   norm_eps=config.get("rms_norm_eps", 1e-6), hidden_size=config["hidden_size"],
                   **KDA_VARIANTS[family])


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (fla's l2norm: eps inside the root, not a clamp)."""
    return x * torch.rsqrt(x.square().sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, tail: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv. x [B, T, C], weight [C, W], tail [B, W-1, C] (the inputs before x).

    Returns (out [B, T, C], new tail [B, W-1, C]); out[t] = sum_j weight[:, j] * input[t - (W-1) + j].
    """
    T, W = x.shape[1], weight.shape[1]
    xs = torch.cat([tail, x], dim=1)
    out = xs[:, :T] * weight[:, 0]
    for j in range(1, W):
        out = out + xs[:, j:j + T] * weight[:, j]
    return out, xs[:, T:].clone()  # a copy: a view would keep all of xs alive in the cache


class KimiDeltaAttention:
    """One KDA layer; all input projections (q, k, v, f_a, b, g_a | g_proj) fused into one Linear."""

    def __init__(self, config: Config, in_proj: Linear, f_b_proj: Linear, g_b_proj: Linear | None,
                 o_proj: Linear, conv_weight: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                 o_norm: torch.Tensor):
        self.config = config
        H, K = config.num_heads, config.head_dim
        gate_in = H * K if config.full_rank_gate else K
        self.split = (3 * H * K, K, H, gate_in)  # qkv, f_a, b, gate
        self.in_proj, self.f_b_proj, self.g_b_proj, self.o_proj = in_proj, f_b_proj, g_b_proj, o_proj
        self.conv_weight = conv_weight.float().contiguous()  # [3 H K, W]
        self.decay_rate = A_log.float().exp().view(1, 1, H, 1)  # exp(A_log[h])
        self.dt_bias = dt_bias.float().contiguous().view(H, K)
        self.o_norm = o_norm.float().contiguous()

    @property
    def device(self) -> torch.device:
        """Where the layer's weights live, and so its cache."""
        return self.conv_weight.device

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> DeltaStateCache:
        """The recurrent state on the layer's device; it stays fp32 whatever the K/V cache `dtype`
        (state_cache.py says why)."""
        H, K = self.config.num_heads, self.config.head_dim
        return DeltaStateCache(batch, H, K, K, 3 * H * K, self.config.conv_kernel, self.device)

    def nbytes(self) -> int:
        linears = self.in_proj.nbytes() + self.f_b_proj.nbytes() + self.o_proj.nbytes()
        linears += self.g_b_proj.nbytes() if self.g_b_proj is not None else 0
        return linears + sum(t.nbytes for t in (self.conv_weight, self.decay_rate, self.dt_bias, self.o_norm))

    def decay(self, f: torch.Tensor) -> torch.Tensor:
        """Per-channel log-decay g [B, T, H, K] (<= 0) from f = f_b(f_a(x)) [B, T, H, K]."""
        f = f + self.dt_bias
        if self.config.bounded_gate:
            return self.config.gate_lower_bound * torch.sigmoid(self.decay_rate * f)
        return -self.decay_rate * F.softplus(f)

    def __call__(self, x: torch.Tensor, step: Step, cache: DeltaStateCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; folds this step's tokens into `cache`."""
        B, T, _ = x.shape
        H, K = self.config.num_heads, self.config.head_dim
        if cache.offset != step.start:
            raise LocalMoEError(f"KDA cache holds {cache.offset} tokens but this step starts at {step.start}")
        # [B, T] False at left padding; from step.valid, not the mask: when a whole prefill chunk of a row is
        # padding, its last query row sees only itself and would pass for a real token
        valid = step.valid
        if valid is not None:  # zeroed padding: the conv tail sees zeros, as at the start of a sequence
            x = x * valid[..., None]
        if mixer_available(x, K):
            return self._native(x, valid, cache)
        qkv, f, b, gate = self.in_proj(x).split(self.split, dim=-1)
        qkv, tail = causal_conv(qkv, self.conv_weight, cache.conv_tail)
        q, k, v = F.silu(qkv).view(B, T, 3, H, K).unbind(2)
        q, k = l2norm(q) * K ** -0.5, l2norm(k)
        g = self.decay(self.f_b_proj(f).view(B, T, H, K))
        beta = torch.sigmoid(b)
        if valid is not None:  # padding neither decays nor writes the state
            g, beta = g * valid[..., None, None], beta * valid[..., None]
        # a bounded gate lies in [gate_lower_bound, 0): fla's chunk_kda then takes its safe-gate path (CUDA)
        bound = self.config.gate_lower_bound if self.config.bounded_gate else None
        o, state = kda(q, k, v, g, beta, cache.state, bound)
        cache.advance(state, tail, T)
        if self.g_b_proj is not None:
            gate = self.g_b_proj(gate)
        o = F.rms_norm(o, (K,), self.o_norm, self.config.norm_eps) * torch.sigmoid(gate.view(B, T, H, K))
        return self.o_proj(o.reshape(B, T, H * K))

    def _native(self, x: torch.Tensor, valid: torch.Tensor | None, cache: DeltaStateCache) -> torch.Tensor:
        """`__call__` on the CPU: the projections here, everything between them in one C++ call (kernels/kda
        `kda_chunk`: each token with the fused decode step's arithmetic)."""
        c = self.config
        H, K = c.num_heads, c.head_dim
        C = 3 * H * K
        y = self.in_proj(x).float().contiguous()  # [B, T, 3 H K | K | H | gate]
        f = self.f_b_proj(y[..., C:C + K]).float().contiguous()
        gate = y[..., C + K + H:]
        if self.g_b_proj is not None:
            gate = self.g_b_proj(gate).float().contiguous()
        o, state, tail = kda_chunk(y, f, gate, valid, cache.state, cache.conv_tail, self.conv_weight,
                                   self.decay_rate.reshape(H), self.dt_bias, self.o_norm, c.bounded_gate,
                                   c.gate_lower_bound, c.norm_eps, in_place=not cache.recording)
        cache.advance(state, tail, x.shape[1])
        return self.o_proj(o)


def state_bytes(config: Config, batch: int = 1) -> int:
    """Bytes of one layer's cache: fp32 state + conv tails (independent of the context length)."""
    H, K = config.num_heads, config.head_dim
    return 4 * batch * (H * K * K + (config.conv_kernel - 1) * 3 * H * K)


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `self_attn.*` shapes; K3's full-rank gate and padded A_log by the variant."""
    a, D, H, K, W = prefix + "self_attn.", cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.conv_kernel
    shapes = {a + "q_proj.weight": (H * K, D), a + "k_proj.weight": (H * K, D), a + "v_proj.weight": (H * K, D),
              **{a + f"{x}_conv1d.weight": (H * K, 1, W) for x in "qkv"},
              a + "f_a_proj.weight": (K, D), a + "f_b_proj.weight": (H * K, K),
              a + "dt_bias": (H * K,), a + "b_proj.weight": (H, D), a + "o_norm.weight": (K,),
              a + "o_proj.weight": (D, H * K)}
    if cfg.full_rank_gate:  # K3: g_proj, A_log stored padded to max(H, K)
        return shapes | {a + "g_proj.weight": (H * K, D), a + "A_log": (max(H, K),)}
    return shapes | {a + "g_a_proj.weight": (K, D), a + "g_b_proj.weight": (H * K, K), a + "A_log": (1, 1, H, 1)}


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> KimiDeltaAttention:
    """A KDA layer from layer `prefix`'s `self_attn.*` as Moonshot stores it (separate q/k/v_conv1d, forget gate
    inline; shapes checked on load), on `device`."""
    H = cfg.num_heads
    p = prefix + "self_attn."

    def w(name: str) -> torch.Tensor:
        return on_device(weights[p + name], device)

    gate = [w("g_proj.weight")] if cfg.full_rank_gate else [w("g_a_proj.weight")]
    in_proj = make_linear([w("q_proj.weight"), w("k_proj.weight"), w("v_proj.weight"), w("f_a_proj.weight"),
                           w("b_proj.weight"), *gate], None, dtype)
    conv = torch.cat([w(f"{x}_conv1d.weight")[:, 0] for x in "qkv"])
    A_log = w("A_log").flatten()
    if A_log.numel() < H:
        raise CheckpointError(f"{p}A_log: {A_log.numel()} values for {H} heads")
    g_b = None if cfg.full_rank_gate else make_linear([w("g_b_proj.weight")], None, dtype)
    return KimiDeltaAttention(cfg, in_proj, make_linear([w("f_b_proj.weight")], None, dtype), g_b,
                              make_linear([w("o_proj.weight")], None, dtype), conv,
                              A_log[:H],  # K3 stores A_log padded to max(H, K); the first H are live
                              w("dt_bias"), w("o_norm.weight"))


__all__ = ["KDA_VARIANTS", "Config", "KimiDeltaAttention", "build", "causal_conv", "chunk_kda", "l2norm",
           "recurrent_kda", "state_bytes", "tensors"]
