"""Grouped-query attention for one new query per sequence, the spec in plain PyTorch (fp32)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True, eq=False)
class PagedKV:
    """One sequence's paged K/V of one layer (engine/cache.py PagedBuffer): pools [Hkv, P, block, D],
    tables [n] long of the physical blocks holding its positions 0 .. n * block - 1, in order.
    `address`: the CPU kernel's view of it (cpu.py), filled on first use."""
    key_pool: torch.Tensor
    key_table: torch.Tensor
    value_pool: torch.Tensor
    value_table: torch.Tensor
    address: tuple[int, ...] | None = None


def naive_gqa_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, first: int = 0,
                     visible: torch.Tensor | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, D]; keys, values [B, Hkv, S, D] (query head h reads KV head h // (H / Hkv)) -> [B, H, D].

    Attends to keys first .. S-1 that `visible` [B, S] (bool, None = all) allows, softmax of
    q.k * scale; `sinks` [H]: one more logit per head in the softmax's denominator, with no value.
    A head that sees no key and has no sink gets zeros.
    """
    B, H = q.shape[:2]
    group = H // keys.shape[1]
    k = keys[:, :, first:].float().repeat_interleave(group, dim=1)  # [B, H, S', D]
    v = values[:, :, first:].float().repeat_interleave(group, dim=1)
    scores = torch.einsum("bhd,bhsd->bhs", q.float(), k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None, first:], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, H, 1).expand(B, H, 1)], dim=-1)
    probs = torch.nan_to_num(scores.softmax(dim=-1), nan=0.0)  # a head that sees nothing: all -inf
    if sinks is not None:
        probs = probs[..., :-1]
    return torch.einsum("bhs,bhsd->bhd", probs, v)


def naive_gqa_decode_paged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, caches: list[PagedKV], positions,
                           firsts, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """N sequences' decode attention over their own paged caches. q [N, H, D]; k, v [N, Hkv, D] the rows'
    new keys/values; caches[n]: row n's sequence's cache, its tables long enough for positions[n]. Row
    n's k/v are written at positions[n] of its pools (every row's before any attention: rows may share
    a cache at consecutive positions), then its heads attend to keys firsts[n] .. positions[n]
    (naive_gqa_decode, with `sinks` [H]). -> [N, H, D]."""
    for n, c in enumerate(caches):
        pos, block = positions[n], c.key_pool.shape[2]
        page = slice(pos // block, pos // block + 1)  # a tensor index: no host sync on a device
        c.key_pool[:, c.key_table[page], pos % block] = k[n, :, None].to(c.key_pool.dtype)
        c.value_pool[:, c.value_table[page], pos % block] = v[n, :, None].to(c.value_pool.dtype)
    out = []
    for n, c in enumerate(caches):
        length, block = positions[n] + 1, c.key_pool.shape[2]
        used = -(-length // block)
        keys = c.key_pool[:, c.key_table[:used]].flatten(1, 2)[None, :, :length]  # [1, Hkv, length, D]
        values = c.value_pool[:, c.value_table[:used]].flatten(1, 2)[None, :, :length]
        out.append(naive_gqa_decode(q[n:n + 1], keys, values, scale, firsts[n], None, sinks))
    return torch.cat(out)


def naive_gqa_step(x: torch.Tensor, wqkv: torch.Tensor, bqkv: torch.Tensor | None, heads: int, kv_heads: int,
                   rot: int, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                   pos: int, first: int, sinks: torch.Tensor | None, scale: float, wo: torch.Tensor,
                   bo: torch.Tensor | None, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor:
    """One attention decode step of one sequence, computed in x's dtype (fp32, or float64 for tests).

    x [hidden]; wqkv [(H + 2 Hkv) D, hidden] (rows q | k | v), bqkv or None; q and k heads rotated on
    their first `rot` dims: x * cos + rotate_half(x) * signed_sin (tables [rot] at this position,
    engine/rope.py), after a per-head RMSNorm by q_norm / k_norm [D] when given (Qwen3; eps theirs);
    k, v written into keys/values [Hkv, >pos, D] at `pos`; attention of each q head
    over keys first..pos with `sinks` [H] (naive_gqa_decode); then wo [hidden, H D], bo. -> [hidden]."""
    dt = x.dtype
    D = keys.shape[-1]
    qkv = x @ wqkv.to(dt).T + (0 if bqkv is None else bqkv.to(dt))
    qk, v = qkv[:(heads + kv_heads) * D].view(heads + kv_heads, D), qkv[(heads + kv_heads) * D:].view(kv_heads, D)
    if q_norm is not None:
        w = torch.cat([q_norm.to(dt).expand(heads, D), k_norm.to(dt).expand(kv_heads, D)])
        qk = qk * torch.rsqrt(qk.pow(2).mean(-1, keepdim=True) + eps) * w
    r = qk[:, :rot]
    qk = torch.cat([r * cos.to(dt) + torch.roll(r, rot // 2, dims=-1) * signed_sin.to(dt), qk[:, rot:]], dim=-1)
    keys[:, pos], values[:, pos] = qk[heads:].to(keys.dtype), v.to(values.dtype)
    k = keys[:, first:pos + 1].to(dt).repeat_interleave(heads // kv_heads, dim=0)  # [H, S', D]
    vv = values[:, first:pos + 1].to(dt).repeat_interleave(heads // kv_heads, dim=0)
    scores = torch.einsum("hd,hsd->hs", qk[:heads], k) * scale
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(dt)[:, None]], dim=-1)
    probs = scores.softmax(dim=-1)[:, :k.shape[1]]
    attn = torch.einsum("hs,hsd->hd", probs, vv).reshape(-1)
    return attn @ wo.to(dt).T + (0 if bo is None else bo.to(dt))
