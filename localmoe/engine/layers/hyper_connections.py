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

import torch
import torch.nn.functional as F

Sublayer = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, collapsed input [B, T, D]) -> output [B, T, D]


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

    @classmethod
    def from_weights(cls, spec, weights: dict[str, torch.Tensor]) -> HyperConnections:
        """From canonical `layers.{i}.hc_{attn,ffn}_{fn,base,scale}`; N = spec.hc_mult."""
        N = spec.hc_mult

        def hc(i: int, kind: str) -> HyperConnection:  # shapes checked on load
            p = f"layers.{i}.hc_{kind}_"
            return HyperConnection(weights[p + "fn"], weights[p + "base"], weights[p + "scale"], N,
                                   spec.rms_norm_eps, spec.hc_eps, spec.hc_sinkhorn_iters)

        n = spec.num_layers
        return cls([hc(i, "attn") for i in range(n)], [hc(i, "ffn") for i in range(n)], N)

    def nbytes(self) -> int:
        return sum(h.nbytes() for h in (*self.attn, *self.mlp))

    def run(self, x: torch.Tensor, attn: Sublayer, mlp: Sublayer) -> torch.Tensor:
        """x: embeddings [B, T, D]; attn/mlp(i, h) run layer i's normed sublayer -> the streams' mean [B, T, D]."""
        streams = x.unsqueeze(-2).expand(*x.shape[:-1], self.streams, x.shape[-1])
        for i, (attn_hc, mlp_hc) in enumerate(zip(self.attn, self.mlp)):
            streams = attn_hc(streams, lambda h, i=i: attn(i, h))
            streams = mlp_hc(streams, lambda h, i=i: mlp(i, h))
        return streams.mean(-2)
