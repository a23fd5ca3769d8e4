"""GLM-5-Next's k-pool indexer: DSA's lightning indexer (engine/layers/indexer.py) scoring POOLS of
`index_kpool` = P consecutive tokens instead of single tokens.

Per token the cache keeps the index key k [Di] = LayerNorm(wk(x)) and its pool-gate logits
g [Di] = index_kpool_compress_gate x (cache rows [k; g], 2 Di values). Pools start at a row's
first real (non-padding) token: pool j holds tokens first + jP .. first + jP + P - 1 and is
complete when all P are cached and real. Its key is a per-channel softmax-weighted mean:
    K_j = sum_i softmax_i(g_i + ape_i) * k_i        (i over the pool, ape = index_kpool_compress_ape [P, Di])
A query t scores each complete pool whose last token it sees, as DSA scores a token:
    I[t, j] = sum_h w[t, h] * Hi^-0.5 * Di^-0.5 * relu(q[t, h] . K_j)
keeps the best index_topk / P pools (kernels/topk_select `top_columns`: of equal scores the earlier pool)
and attends to all their tokens, plus (`index_kpool_tail`, transformers'
`index_kpool_always_select_tail`) the tokens of its own incomplete pool, the last
(visible count mod P) it sees. So up to index_topk + P - 1 tokens; -1 pads. While every query
sees fewer than index_topk + P tokens nothing is dropped (`dense_context`).

A complete pool's key never changes: an unpadded call keeps them (index_cache.KeptPools) and pools only the
tokens after the kept pools (the same bits as pooling everything again: each pool's softmax and sum see only
its own P rows), so a decode token costs O(P Di) of pooling, not O(S Di). Padded calls pool everything.
"""

from __future__ import annotations

import torch

from localmoe.engine.layers.indexer import LightningIndexer
from localmoe.engine.linear import Linear
from localmoe.engine.step import Step
from localmoe.errors import LocalMoEError
from localmoe.kernels.topk_select import top_columns


def pool_keys(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, valid: torch.Tensor,
              padded: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """keys, gates [B, S, Di], ape [P, Di], valid [B, S] (False at padding) -> pooled keys [B, J, Di],
    members [B, J, P] (token indices, -1 where absent), complete [B, J]; J = ceil(S / P) pools from each
    row's first real token, cut after the last pool complete in some row: S // P without padding
    (`padded` False), else counted on the device and read by the host."""
    B, S, _ = keys.shape
    P = ape.shape[0]
    first = torch.where(valid.any(-1), valid.long().argmax(-1), S)  # [B]
    J = -(-S // P)
    members = first[:, None, None] + torch.arange(J * P, device=keys.device).view(1, J, P)
    safe = members.clamp(max=S - 1)
    present = (members < S) & valid.gather(1, safe.flatten(1)).view(B, J, P)
    rows = torch.arange(B, device=keys.device)[:, None, None]
    logits = (gates[rows, safe] + ape).masked_fill(~present[..., None], float("-inf"))
    weights = logits.softmax(dim=2).nan_to_num()  # pools with no token present: all -inf -> 0
    pooled = (weights * keys[rows, safe]).sum(2)
    complete = present.all(-1)
    keep = int(complete.any(0).sum()) if padded else S // P  # complete pools are a prefix of each row's pools
    return pooled[:, :keep], members.masked_fill(~present, -1)[:, :keep], complete[:, :keep]


def key_validity(step: Step, B: int, S: int) -> torch.Tensor:
    """[B, S] bool: which cached positions hold real tokens. Padding is left padding, so the call's last
    query of a row sees every real key (or, if it is padding itself, the row has none yet)."""
    if step.mask is None:
        return torch.ones(B, S, dtype=torch.bool, device=step.positions.device)
    valid = step.mask[:, -1, :S].expand(B, S)
    return valid & step.valid[:, -1:] if step.valid is not None else valid


class KPoolIndexer(LightningIndexer):
    """A LightningIndexer (wq_b, wk, k_norm, weights_proj) plus the pool gate [Di, hidden] and ape [P, Di]."""

    def __init__(self, *indexer, gate: Linear, ape: torch.Tensor, pool: int = 16, tail: bool = True):
        """`indexer`: LightningIndexer's arguments; `pool` = index_kpool, `tail` = index_kpool_tail."""
        super().__init__(*indexer)
        if pool < 1 or self.top_k % pool:
            raise LocalMoEError(f"index_topk {self.top_k} must be a positive multiple of index_kpool {pool}")
        self.gate, self.ape, self.pool, self.tail = gate, ape.float(), pool, tail

    @property
    def cache_dim(self) -> int:
        return 2 * self.head_dim  # key, then pool-gate logits

    @property
    def dense_context(self) -> int:
        if self.tail:
            return self.top_k + self.pool - 1
        return self.top_k if self.pool == 1 else 0  # without the tail the newest tokens are never all seen

    @property
    def width(self) -> int:
        """Indices per query that `select` returns."""
        return self.top_k + (self.pool - 1 if self.tail else 0)

    def nbytes(self) -> int:
        return super().nbytes() + self.gate.nbytes() + self.ape.nbytes

    def keys(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [B, T, hidden] -> cache rows [B, T, 2 Di]: the index key, then the pool-gate logits."""
        return torch.cat([super().keys(x, step), self.gate(x)], dim=-1)

    def pooled(self, cached: torch.Tensor, valid: torch.Tensor, step: Step, kept=None):
        """`pool_keys` of the cached rows [B, S, 2 Di]; unpadded with a `kept` store (index_cache.KeptPools): the
        kept pools' keys and only the later ones computed (then kept too)."""
        Di = self.head_dim
        if kept is None or step.mask is not None:
            return pool_keys(cached[..., :Di], cached[..., Di:], self.ape, valid, step.mask is not None)
        B, S = valid.shape
        P = self.pool
        J = S // P
        done = 0 if kept.keys is None else kept.keys.shape[1]
        if done < J:
            new = cached[:, done * P:]
            fresh = pool_keys(new[..., :Di], new[..., Di:], self.ape, valid[:, done * P:], False)[0]
            kept.keys = fresh if kept.keys is None else torch.cat([kept.keys, fresh], dim=1)
        if J == 0:
            return cached.new_zeros(B, 0, Di), valid.new_zeros(B, 0, P, dtype=torch.long), valid[:, :0]
        members = torch.arange(J * P, device=cached.device).view(1, J, P).expand(B, J, P)
        return kept.keys[:, :J], members, torch.ones(B, J, dtype=torch.bool, device=cached.device)

    def select(self, q: torch.Tensor, w: torch.Tensor, cached: torch.Tensor, step: Step, kept=None) -> torch.Tensor:
        """q [B, T, Hi, Di], w [B, T, Hi] (scaled), cached rows [B, S, 2 Di] -> token indices [B, T, width]
        (-1 pads). A padding query keeps only its own position (its output is ignored, but stays finite).
        `kept`: the cache's store of complete pools' keys (index_cache.KeptPools), or None."""
        B, T = q.shape[:2]
        S, P = cached.shape[1], self.pool
        valid = key_validity(step, B, S)
        pooled, members, complete = self.pooled(cached, valid, step, kept)
        J = pooled.shape[1]
        positions = torch.arange(step.start, step.start + T, device=q.device)  # cache positions of the queries
        seen = complete[:, None, :] & (members[:, None, :, -1] <= positions[None, :, None])  # [B, T, J]
        scores = torch.einsum("bth,bthj->btj", w, torch.einsum("bthd,bjd->bthj", q, pooled).relu())
        scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
        k = min(self.top_k // P, J)
        chosen = top_columns(scores, k)[0]  # [B, T, k], increasing
        tokens = members[torch.arange(B, device=q.device)[:, None, None], chosen]  # [B, T, k, P]
        tokens = tokens.masked_fill(~seen.gather(-1, chosen)[..., None], -1).flatten(2)
        parts = [tokens]
        counts = valid.long().cumsum(-1)[:, positions]  # [B, T] real tokens each query sees
        if self.tail and P > 1:
            first = torch.where(valid.any(-1), valid.long().argmax(-1), S)
            in_tail = counts % P
            offsets = torch.arange(P - 1, device=q.device)
            tail = (first[:, None] + counts - in_tail)[..., None] + offsets  # [B, T, P - 1]
            parts.append(tail.masked_fill(offsets >= in_tail[..., None], -1))
        out = torch.cat(parts, dim=-1)
        out = torch.cat([out, out.new_full((B, T, self.width - out.shape[-1]), -1)], dim=-1)
        if step.valid is not None:  # padding queries: themselves only
            own = torch.full_like(out, -1)
            own[..., 0] = positions
            out = torch.where(step.valid[..., None], out, own)
        return out
