"""Kimi K3 attention residuals: a learned mix over depth replaces the plain residual stream.

The stream is kept as stored block representations plus a running partial sum `ps` of
the current block. Before each sublayer its input is a softmax-weighted mix of
V = [blocks..., ps] (per token, over depth):
    k = V * rsqrt(mean(V^2) + eps);  score = k . (res_norm.weight * res_proj.weight);
    mix = softmax(score over V) . V
Per layer L (0-based): x = mix(self_attention_res) if blocks exist else ps; every
`block_size` layers (L % block_size == 0) ps is stored as a block and restarted;
ps += attn(input_layernorm(x)); x = mix(mlp_res); ps += mlp(post_attention_layernorm(x)).
The model's output is mix(output_attn_res) -> norm -> lm_head. All of it in fp32: the mix
is sensitive to summation order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from localmoe.engine.layers import on_device
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS

Sublayer = Callable[[int, torch.Tensor], torch.Tensor]  # (layer, normalised-input source x) -> output


@dataclass(frozen=True, slots=True)
class Config:
    """K3's attention residuals (ModelSpec.attn_res): one depth mix before every sublayer and the output."""

    block_size: int  # layers per stored block (`attn_res_block_size`)
    num_layers: int
    hidden_size: int  # D, the model's
    eps: float = 1e-6  # the mixes' RMS floor (the model's rms_norm_eps)


def tensors(cfg: Config, prefix: str = "") -> dict[str, tuple[int, ...]]:
    """`layers.{i}.{self_attention,mlp}_res_{norm,proj}.weight` and `output_attn_res_{norm,proj}.weight`."""
    stems = [*(f"{prefix}layers.{i}.{s}" for i in range(cfg.num_layers) for s in ("self_attention", "mlp")),
             prefix + "output_attn"]
    D = cfg.hidden_size
    return {name: shape for stem in stems
            for name, shape in ((f"{stem}_res_norm.weight", (D,)), (f"{stem}_res_proj.weight", (1, D)))}


def residual_query(weights: dict[str, torch.Tensor], stem: str) -> torch.Tensor:
    """The pseudo-query [D] of one mix: `{stem}_res_norm.weight` * `{stem}_res_proj.weight` ([1, D])."""
    return (weights[f"{stem}_res_norm.weight"].float() * weights[f"{stem}_res_proj.weight"].float()[0]).contiguous()


def depth_mix(values: list[torch.Tensor], query: torch.Tensor, eps: float) -> torch.Tensor:
    """values: N tensors [B, T, D] fp32, query [D] -> [B, T, D], softmax over the N entries.

    Decode-sized calls (B * T <= GEMV_MAX_ROWS: batched rows, speculative verify) reduce element-wise, so
    a token's bits do not depend on the other tokens of the call (engine/batch.py); torch's matmul sums in an
    order that does. Prefill keeps the matmul for the scores, then adds the weighted entries one at a time
    (no [N, B, T, D] product temporary): the bits of torch's einsum "nbt,nbtd->btd" (products rounded, summed
    in entry order), which took ~4x as long (a batched matmul per token), K3 `small`'s [72, 768]."""
    V = torch.stack(values)  # [N, B, T, D]
    k = V * torch.rsqrt(V.square().mean(-1, keepdim=True) + eps)
    if V.shape[1] * V.shape[2] <= GEMV_MAX_ROWS:
        weights = (k * query).sum(-1).softmax(dim=0)  # [N, B, T]
        return (weights[..., None] * V).sum(0)
    weights = (k @ query).softmax(dim=0)[..., None]  # [N, B, T, 1]
    out = weights[0] * V[0]
    for n in range(1, V.shape[0]):
        out.add_(weights[n] * V[n])
    return out


class AttentionResiduals:
    """The per-layer queries of K3's block attention residuals and the loop that uses them."""

    def __init__(self, block_size: int, attn_queries: list[torch.Tensor], mlp_queries: list[torch.Tensor],
                 output_query: torch.Tensor, eps: float):
        self.block_size, self.eps = block_size, eps
        self.attn_queries, self.mlp_queries, self.output_query = attn_queries, mlp_queries, output_query

    def nbytes(self) -> int:
        return sum(q.nbytes for q in (*self.attn_queries, *self.mlp_queries, self.output_query))

    def run(self, x: torch.Tensor, attn: Sublayer, mlp: Sublayer) -> torch.Tensor:
        """x: embeddings [B, T, D]; attn/mlp(i, x) run layer i's normed sublayer -> the mixed output [B, T, D]."""
        blocks: list[torch.Tensor] = []
        partial = x
        for i in range(len(self.attn_queries)):
            h = depth_mix([*blocks, partial], self.attn_queries[i], self.eps) if blocks else partial
            restart = i % self.block_size == 0
            if restart:
                blocks.append(partial)
            a = attn(i, h)
            partial = a if restart else partial + a
            h = depth_mix([*blocks, partial], self.mlp_queries[i], self.eps)
            partial = partial + mlp(i, h)
        return depth_mix([*blocks, partial], self.output_query, self.eps)


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str = "", device: str = "cpu"
          ) -> AttentionResiduals:
    """The per-layer queries from `tensors(cfg, prefix)`'s weights (shapes checked on load), on `device`."""
    def query(stem: str) -> torch.Tensor:
        return on_device(residual_query(weights, prefix + stem), device)

    n = cfg.num_layers
    return AttentionResiduals(cfg.block_size, [query(f"layers.{i}.self_attention") for i in range(n)],
                              [query(f"layers.{i}.mlp") for i in range(n)], query("output_attn"), cfg.eps)
