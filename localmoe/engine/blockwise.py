"""Softmax attention one key block at a time: working memory set by the block, not by the context.

`blockwise_attention` runs the online softmax (a running maximum and normaliser per query row,
as flash attention does) over blocks of keys that the caller builds on demand, so neither the
[rows, S] score matrix nor per-head copies of long K/V ever exist whole. Masks are sliced per
block from the caller's mask, or built per block by the caller's function (DSA's selected keys:
no [T, S] mask at all) or, for an unpadded causal step (mask None), built per block only
where the block reaches past the step's first query: earlier blocks are fully visible.
When every key fits one block the result is the plain `softmax(scores) @ values`, bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

MIN_BLOCK = 64  # keys per block at the least (a smaller block costs more Python than it saves memory)


Mask = torch.Tensor | Callable[[int, int], torch.Tensor] | None


def visible_keys(mask: Mask, T: int, S: int, lo: int, hi: int, device: torch.device) -> torch.Tensor | None:
    """Which keys lo..hi-1 each of the step's T queries sees, [B|1, 1, T, hi - lo] bool; None when all.
    mask [B|1, T, S] (True = visible), a function (lo, hi) -> its block [B|1, T, hi - lo], or None: causal,
    query t at cache position S - T + t (built on `device`)."""
    if callable(mask):
        return mask(lo, hi)[:, None]
    if mask is not None:
        return mask[:, None, :, lo:hi]
    first = S - T  # the first query's position
    if hi <= first + 1:
        return None
    return (torch.arange(lo, hi, device=device)[None, :] <= torch.arange(first, S, device=device)[:, None])[None, None]


def blockwise_attention(q: torch.Tensor, kv_block: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], S: int,
                        mask: Mask, scale: float, heads_tokens: tuple[int, int] | None = None,
                        max_bytes: int = 32 << 20) -> torch.Tensor:
    """softmax(q keys^T * scale, masked) values over S keys, block by block.

    q [B, G, L, d]; kv_block(lo, hi) -> keys [B|1, G|1, n, d], values [B|1, G|1, n, dv] for keys lo..hi-1;
    heads_tokens (H, T) with H*T = G*L says how the G*L query rows map onto the mask's T queries
    (row h*T + t; default (G, L)); mask as in `visible_keys`. Each block's scores take at most
    `max_bytes` (fp32), at least MIN_BLOCK keys. Returns [B, G, L, dv] fp32."""
    B, G, L, _ = q.shape
    H, T = heads_tokens or (G, L)
    block = max(MIN_BLOCK, max_bytes // (4 * B * G * L))
    if block >= S:
        keys, values = kv_block(0, S)
        scores = (q @ keys.transpose(-1, -2)).mul_(scale)
        visible = visible_keys(mask, T, S, 0, S, q.device)
        if visible is not None:
            scores.view(B, H, T, S).masked_fill_(~visible, float("-inf"))
        return scores.softmax(-1) @ values
    peak = q.new_full((B, G, L, 1), float("-inf"))  # running maximum score per query row
    total = q.new_zeros((B, G, L, 1))  # running sum of exp(score - peak)
    out = None
    for lo in range(0, S, block):
        hi = min(S, lo + block)
        keys, values = kv_block(lo, hi)
        scores = (q @ keys.transpose(-1, -2)).mul_(scale)
        visible = visible_keys(mask, T, S, lo, hi, q.device)
        if visible is not None:
            scores.view(B, H, T, hi - lo).masked_fill_(~visible, float("-inf"))
        new_peak = torch.maximum(peak, scores.amax(-1, keepdim=True))
        shift = new_peak.masked_fill(new_peak == float("-inf"), 0.0)  # rows that saw no key yet: exp(-inf) = 0
        probs = scores.sub_(shift).exp_()
        keep = (peak - shift).exp_()  # rescales what earlier blocks summed
        total = total.mul_(keep).add_(probs.sum(-1, keepdim=True))
        part = probs @ values
        out = part if out is None else out.mul_(keep).add_(part)
        peak = new_peak
        del keys, values, scores, probs, part  # freed before the next block allocates its own
    return out.div_(total)
