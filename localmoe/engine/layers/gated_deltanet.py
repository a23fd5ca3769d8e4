"""Gated DeltaNet (Qwen3-Next `linear_attention` layers): the delta rule with ONE decay per head.

Per value head, with an fp32 state S [K, V] and scalar log-decay g (<= 0):
    S <- exp(g) S ;  S <- S + k (beta (v - S^T k))^T ;  o = S^T q
q, k, v come from one depthwise causal conv + SiLU over q|k|v; q and k are L2-normalised
(eps 1e-6) and q is scaled by K^-0.5. Hk key heads serve Hv = G * Hk value heads (head
j of the values reads key head j // G, like grouped-query attention).
    g = -exp(A_log[h]) * softplus(a + dt_bias[h]),  beta = sigmoid(b)
Output: out_proj(RMSNorm_head(o) * silu(z)) (a gated RMSNorm, plain `x * w`).

Qwen stores the input projections grouped per KEY head (`in_proj_qkvz` rows per key head:
q [K], k [K], v [G V], z [G V]; `in_proj_ba`: b [G], a [G]); `build` reorders them
once into one fused projection [q; k; v; z; b; a]. The delta rule runs through the
`localmoe.kernels.gated_delta` dispatcher; where the CPU kernel library runs, everything between
the projections is one C++ call per layer instead (`gdn_chunk`: the fused decode step's
arithmetic per token, value heads reading their key head without a repeated copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device
from localmoe.engine.layers.kda import causal_conv, l2norm
from localmoe.engine.linear import Linear
from localmoe.engine.state_cache import DeltaStateCache
from localmoe.engine.step import Step
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.kernels.gated_delta import gated_delta, gdn_chunk, mixer_available


@dataclass(frozen=True, slots=True)
class Config:
    """Gated DeltaNet dimensions (ModelSpec.gated_delta)."""

    num_key_heads: int  # Hk (q and k heads)
    num_value_heads: int  # Hv, a multiple of Hk
    key_head_dim: int  # K
    value_head_dim: int  # V
    conv_kernel: int = 4
    norm_eps: float = 1e-6  # the gated output norm's epsilon (the model's rms_norm_eps)
    hidden_size: int = 0  # D, the model's

    def __post_init__(self) -> None:
        if self.num_key_heads < 1 or self.num_value_heads % self.num_key_heads:
            raise LocalMoEError(f"Gated DeltaNet: linear_num_value_heads={self.num_value_heads} is not a multiple of "
                                f"linear_num_key_heads={self.num_key_heads}")

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Config:
        """From a Qwen3-Next config.json dict (`linear_*` keys)."""
        try:
            return cls(num_key_heads=config["linear_num_key_heads"], num_value_heads=config["linear_num_value_heads"],
                       key_head_dim=config["linear_key_head_dim"], value_head_dim=config["linear_value_head_dim"],
                       conv_kernel=config.get("linear_conv_kernel_dim", 4), norm_eps=config.get("rms_norm_eps", 1e-6),
                       hidden_size=config["hidden_size"])
        except KeyError as e:
            raise CheckpointError(f"config.json: field {e.args[0]!r} is missing (needed by the Gated DeltaNet "
                                  "layers)") from None

    @property
    def conv_channels(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


class GatedDeltaNet:
    """One Gated DeltaNet layer; q, k, v, z, b, a from one fused Linear."""

    def __init__(self, config: Config, in_proj: Linear, out_proj: Linear, conv_weight: torch.Tensor,
                 A_log: torch.Tensor, dt_bias: torch.Tensor, norm: torch.Tensor):
        self.config = c = config
        Hv, V = c.num_value_heads, c.value_head_dim
        self.split = (c.conv_channels, Hv * V, Hv, Hv)  # qkv (conv input), z, b, a
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv_weight = conv_weight.float().contiguous()  # [C, W]
        self.decay_rate = A_log.float().exp().contiguous()  # exp(A_log) [Hv]
        self.dt_bias = dt_bias.float().contiguous()  # [Hv]
        self.norm = norm.float().contiguous()  # [V]
        self.group = Hv // c.num_key_heads

    @property
    def device(self) -> torch.device:
        """Where the layer's weights live, and so its cache."""
        return self.conv_weight.device

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> DeltaStateCache:
        """The recurrent state [B, Hv, K, V] + conv tail on the layer's device; fp32 whatever the K/V cache `dtype`."""
        c = self.config
        return DeltaStateCache(batch, c.num_value_heads, c.key_head_dim, c.value_head_dim, c.conv_channels,
                               c.conv_kernel, self.device)

    def nbytes(self) -> int:
        tensors = (self.conv_weight, self.decay_rate, self.dt_bias, self.norm)
        return self.in_proj.nbytes() + self.out_proj.nbytes() + sum(t.nbytes for t in tensors)

    def __call__(self, x: torch.Tensor, step: Step, cache: DeltaStateCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; folds this step's tokens into `cache`."""
        B, T, _ = x.shape
        c = self.config
        Hk, Hv, K, V = c.num_key_heads, c.num_value_heads, c.key_head_dim, c.value_head_dim
        if cache.offset != step.start:
            raise LocalMoEError(f"Gated DeltaNet cache holds {cache.offset} tokens but this step starts at "
                                f"{step.start}")
        valid = step.valid  # [B, T] False at left padding (see kda.py)
        if valid is not None:
            x = x * valid[..., None]
        if mixer_available(x, K, V):  # on the CPU everything between the projections in one C++ call
            o, state, tail = gdn_chunk(self.in_proj(x).float().contiguous(), valid, cache.state, cache.conv_tail,
                                       self.conv_weight, self.decay_rate, self.dt_bias, self.norm, Hk, c.norm_eps,
                                       in_place=not cache.recording)
            cache.advance(state, tail, T)
            return self.out_proj(o)
        qkv, z, b, a = self.in_proj(x).split(self.split, dim=-1)
        qkv, tail = causal_conv(qkv, self.conv_weight, cache.conv_tail)
        q, k, v = F.silu(qkv).split((Hk * K, Hk * K, Hv * V), dim=-1)
        q = (l2norm(q.view(B, T, Hk, K)) * K ** -0.5).repeat_interleave(self.group, dim=2)  # [B, T, Hv, K]
        k = l2norm(k.view(B, T, Hk, K)).repeat_interleave(self.group, dim=2)
        g = -self.decay_rate * F.softplus(a + self.dt_bias)  # [B, T, Hv]
        beta = torch.sigmoid(b)
        if valid is not None:  # padding neither decays nor writes the state
            g, beta = g * valid[..., None], beta * valid[..., None]
        o, state = gated_delta(q, k, v.reshape(B, T, Hv, V), g, beta, cache.state)
        cache.advance(state, tail, T)
        o = F.rms_norm(o, (V,), self.norm, c.norm_eps) * F.silu(z.view(B, T, Hv, V))
        return self.out_proj(o.reshape(B, T, Hv * V))


def state_bytes(config: Config, batch: int = 1) -> int:
    """Bytes of one layer's cache: fp32 state + conv tail (independent of the context length)."""
    c = config
    return 4 * batch * (c.num_value_heads * c.key_head_dim * c.value_head_dim + (c.conv_kernel - 1) * c.conv_channels)


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `linear_attn.*` shapes as Qwen stores them (projections grouped per key head)."""
    a, D = prefix + "linear_attn.", cfg.hidden_size
    Hk, Hv, K, V = cfg.num_key_heads, cfg.num_value_heads, cfg.key_head_dim, cfg.value_head_dim
    G = Hv // Hk
    return {a + "in_proj_qkvz.weight": (Hk * (2 * K + 2 * G * V), D), a + "in_proj_ba.weight": (2 * Hv, D),
            a + "conv1d.weight": (cfg.conv_channels, 1, cfg.conv_kernel), a + "A_log": (Hv,),
            a + "dt_bias": (Hv,), a + "norm.weight": (V,), a + "out_proj.weight": (D, Hv * V)}


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> GatedDeltaNet:
    """A Gated DeltaNet layer from layer `prefix`'s `linear_attn.*` (shapes checked on load), on `device`."""
    Hk, K, V, D = cfg.num_key_heads, cfg.key_head_dim, cfg.value_head_dim, cfg.hidden_size
    G = cfg.num_value_heads // Hk
    p = prefix + "linear_attn."

    def w(name: str) -> torch.Tensor:
        return on_device(weights[p + name], device)

    # rows per key head: [q K | k K | v G*V | z G*V] -> [all q; all k; all v; all z]
    qkvz = w("in_proj_qkvz.weight").view(Hk, 2 * K + 2 * G * V, D)
    q, k, v, z = (t.reshape(-1, D) for t in qkvz.split((K, K, G * V, G * V), dim=1))
    b, a = (t.reshape(-1, D) for t in w("in_proj_ba.weight").view(Hk, 2 * G, D).split(G, dim=1))
    in_proj = Linear(torch.cat([q, k, v, z, b, a]), None, dtype)
    return GatedDeltaNet(cfg, in_proj, Linear(w("out_proj.weight"), None, dtype), w("conv1d.weight")[:, 0],
                         w("A_log"), w("dt_bias"), w("norm.weight"))
