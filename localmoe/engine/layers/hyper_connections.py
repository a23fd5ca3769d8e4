"""Manifold-constrained hyper-connections (mHC, GLM-5-Next): N = `hc_mult` residual streams.

The residual stream is N copies wide, [B, T, N, D]; the embedding starts as N equal streams.
Around each sublayer (attention, then MLP) the streams X [N, D] of a token give, from one
linear map of their RMS-normalised concatenation z = X.flatten() * rsqrt(mean(X^2) + eps):
    [a, b, c] = fn z            fn [(2 + N) N, N D]; a, b [N], c [N, N]
    pre  = sigmoid(a * scale[0] + base[:N]) + hc_eps                   [N]
    post = 2 sigmoid(b * scale[1] + base[N:2N])                        [N]
    comb = Sinkhorn(softmax_rows(c * scale[2] + base[2N:]) + hc_eps)   [N, N], doubly stochastic
Then the sublayer runs on one collapsed stream and its output y [D] is spread back:
    h = sum_n pre[n] X[n];  y = sublayer(norm(h));  X'[n] = post[n] y + sum_m comb[m, n] X[m]
Sinkhorn: divide by the column sums (+ hc_eps), then `hc_sinkhorn_iters` - 1 times by the row
sums and the column sums. The model's output is the plain mean of the N streams (-> norm -> lm_head).
Everything is per token (nothing is cached) and computed in fp32.

Checkpoint names: `layers.{i}.hc_{attn,ffn}_{fn,base,scale}` (fn [(2 + N) N, N D], base
[(2 + N) N], scale [3]).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.layers import on_device

Sublayer = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, collapsed input [B, T, D]) -> output [B, T, D]


@dataclass(frozen=True, slots=True)
class Config:
    """GLM-5-Next's hyper-connections (ModelSpec.hyper_connections)."""

    mult: int  # N residual streams (`hc_mult`)
    num_layers: int
    hidden_size: int  # D, the model's
    eps: float = 1e-6  # floor added to the pre / comb weights and to the Sinkhorn denominators (`hc_eps`)
    sinkhorn_iters: int = 20  # `hc_sinkhorn_iters`
    norm_eps: float = 1e-6  # the RMS normalisation of the streams (the model's rms_norm_eps)


def tensors(cfg: Config, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """`layers.{i}.hc_{attn,ffn}_{fn,base,scale}` of every layer."""
    N, D = cfg.mult, cfg.hidden_size
    return {f"{prefix}layers.{i}.hc_{s}_{t}": shape for i in range(cfg.num_layers) for s in ("attn", "ffn")
            for t, shape in (("fn", ((2 + N) * N, N * D)), ("base", ((2 + N) * N,)), ("scale", (3,)))}


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """comb [..., N, N] > 0 -> approximately doubly stochastic: columns first, then `iters` - 1 row/column rounds."""
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


class HyperConnection:
    """One sublayer's mixing weights: fn [(2 + N) N, N D], base [(2 + N) N], scale [3] (all fp32)."""

    def __init__(self, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: int, norm_eps: float,
                 hc_eps: float, sinkhorn_iters: int):
        self.fn, self.base, self.scale = fn.float().contiguous(), base.float(), scale.float()
        self.n, self.norm_eps, self.hc_eps, self.iters = streams, norm_eps, hc_eps, sinkhorn_iters

    def nbytes(self) -> int:
        return self.fn.nbytes + self.base.nbytes + self.scale.nbytes

    def weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, N, D] -> pre [B, T, N], post [B, T, N], comb [B, T, N, N]."""
        N = self.n
        z = streams.flatten(-2)
        z = z * torch.rsqrt(z.square().mean(-1, keepdim=True) + self.norm_eps)
        a, b, c = F.linear(z, self.fn).split((N, N, N * N), dim=-1)
        pre = torch.sigmoid(a * self.scale[0] + self.base[:N]) + self.hc_eps
        post = 2 * torch.sigmoid(b * self.scale[1] + self.base[N:2 * N])
        c = c.unflatten(-1, (N, N)) * self.scale[2] + self.base[2 * N:].view(N, N)
        return pre, post, sinkhorn(c.softmax(-1) + self.hc_eps, self.iters, self.hc_eps)

    def __call__(self, streams: torch.Tensor, sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """streams [B, T, N, D] -> the streams after `sublayer` ([B, T, D] -> [B, T, D]) and the mix."""
        pre, post, comb = self.weights(streams)
        y = sublayer(torch.einsum("btn,btnd->btd", pre, streams))
        return post[..., None] * y[..., None, :] + torch.einsum("btmn,btmd->btnd", comb, streams)


class HyperConnections:
    """Every layer's attention and MLP hyper-connections, and the loop over layers that uses them."""

    def __init__(self, attn: list[HyperConnection], mlp: list[HyperConnection], streams: int):
        self.attn, self.mlp, self.streams = attn, mlp, streams

    def nbytes(self) -> int:
        return sum(h.nbytes() for h in (*self.attn, *self.mlp))

    def run(self, x: torch.Tensor, attn: Sublayer, mlp: Sublayer) -> torch.Tensor:
        """x: embeddings [B, T, D]; attn/mlp(i, h) run layer i's normed sublayer -> the streams' mean [B, T, D]."""
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.streams, x.shape[-1])
        for i, (attn_hc, mlp_hc) in enumerate(zip(self.attn, self.mlp)):
            streams = attn_hc(streams, lambda h, i=i: attn(i, h))
            streams = mlp_hc(streams, lambda h, i=i: mlp(i, h))
        return streams.mean(-2)


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str = "", device: str = "cpu") -> HyperConnections:
    """Every layer's hyper-connections from `tensors(cfg, prefix)`'s weights (shapes checked on load), on `device`."""
    def hc(i: int, kind: str) -> HyperConnection:
        p = f"{prefix}layers.{i}.hc_{kind}_"
        return HyperConnection(*(on_device(weights[p + t], device) for t in ("fn", "base", "scale")), cfg.mult,
                               cfg.norm_eps, cfg.eps, cfg.sinkhorn_iters)

    n = cfg.num_layers
    return HyperConnections([hc(i, "attn") for i in range(n)], [hc(i, "ffn") for i in range(n)], cfg.mult)
