"""DSA indexer scoring in Triton: one program per (batch * query, BS cached tokens); the query's
index heads stay in registers, the keys stream as [BS, D] tiles (one `tl.dot` for all heads).
The top-k itself is `torch.topk` over the scores (`reference.select_topk`): a radix select in
Triton is left for when a GPU can measure it against torch's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from localmoe.kernels.topk_select.reference import select_topk


@triton.jit
def _scores_kernel(q_ptr, w_ptr, k_ptr, pos_ptr, out_ptr, T, S, H, D,
                   sq_b, sq_t, sq_h, sw_b, sw_t, sk_b, sk_s, so_b, so_t,
                   BH: tl.constexpr, BD: tl.constexpr, BS: tl.constexpr):
    bt = tl.program_id(0)
    b, t = bt // T, bt % T
    offs_h, offs_d = tl.arange(0, BH), tl.arange(0, BD)
    offs_s = tl.program_id(1) * BS + tl.arange(0, BS)
    mh, md, ms = offs_h < H, offs_d < D, offs_s < S
    q = tl.load(q_ptr + b * sq_b + t * sq_t + offs_h[:, None] * sq_h + offs_d[None, :],
                mask=mh[:, None] & md[None, :], other=0.0).to(tl.float32)  # [BH, BD]
    w = tl.load(w_ptr + b * sw_b + t * sw_t + offs_h, mask=mh, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * sk_b + offs_s[:, None] * sk_s + offs_d[None, :], mask=ms[:, None] & md[None, :],
                other=0.0).to(tl.float32)  # [BS, BD]
    logits = tl.maximum(tl.dot(q, tl.trans(k), input_precision="ieee"), 0.0)  # [BH, BS]
    score = tl.sum(w[:, None] * logits, axis=0)
    pos = tl.load(pos_ptr + b * T + t)
    score = tl.where(offs_s <= pos, score, float("-inf"))
    tl.store(out_ptr + b * so_b + t * so_t + offs_s, score, mask=ms)


def indexer_scores(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   block_s: int = 64) -> torch.Tensor:
    """q [B, T, H, D], w [B, T, H], k [B, S, D], positions [B, T] -> scores [B, T, S] fp32."""
    B, T, H, D = q.shape
    S = k.shape[1]
    assert w.shape == (B, T, H) and k.shape == (B, S, D) and positions.shape == (B, T)
    assert q.stride(3) == 1 and k.stride(2) == 1 and w.stride(2) == 1, "innermost dims contiguous"
    out = torch.empty(B, T, S, dtype=torch.float32, device=q.device)
    pos = positions.to(torch.int32).contiguous()
    grid = (B * T, triton.cdiv(S, block_s))
    _scores_kernel[grid](q, w, k, pos, out, T, S, H, D, q.stride(0), q.stride(1), q.stride(2), w.stride(0),
                         w.stride(1), k.stride(0), k.stride(1), out.stride(0), out.stride(1),
                         BH=max(16, triton.next_power_of_2(H)), BD=max(16, triton.next_power_of_2(D)), BS=block_s)
    return out


def topk_select(q, w, k, positions, top_k: int) -> torch.Tensor:
    """Indexer scores (Triton) then top-k: [B, T, top_k] int64, -1 where fewer tokens are visible."""
    return select_topk(indexer_scores(q, w, k, positions), top_k)
