"""The DSA layer's cache: MLA latent rows plus the lightning indexer's keys, side by side.

Index keys are one [index_head_dim] vector per token, shared by all index heads (DeepSeek-V3.2:
128 values). They are kept compactly as the cache dtype says: with "fp8", e4m3 values with ONE
fp32 scale per block of `INDEX_SCALE_BLOCK` values of each token (DeepSeek's indexer cache
layout: 128 values + one scale, 132 bytes per token and layer instead of 512 in fp32). The
blocks are stored as the "heads" of a `PagedBuffer` (engine/cache.py), whose fp8 mode keeps one
`quantize_fp8` scale per token and head: so each block gets its own scale, and the buffer's
paging, trimming and exact ring of the newest positions apply to index keys unchanged.

GLM-5-Next's k-pool indexer scores pools of P tokens by a key pooled from their cached rows; a complete
pool's key never changes, so `KeptPools` keeps them (one store per path: the op-by-op layer's torch bits and
the fused step's kernel bits, each what its path would compute again), dropped on trim.
"""

from __future__ import annotations

import torch

from localmoe.engine.cache import PagedBuffer
from localmoe.engine.state_cache import LatentCache

INDEX_SCALE_BLOCK = 128  # values sharing one fp8 scale (DeepSeek's indexer cache block)


class IndexKeyCache(LatentCache):
    """Index keys [B, S, D] in a PagedBuffer of D / block "heads" of `block` values each."""

    def __init__(self, batch: int, max_len: int, dim: int, dtype: str = "float32",
                 device: str | torch.device = "cpu"):
        self.block = min(INDEX_SCALE_BLOCK, dim)
        if dim % self.block:
            raise ValueError(f"index_head_dim {dim} is not a multiple of the fp8 scale block {self.block}")
        self.dim = dim
        self.rows = PagedBuffer(batch, max_len, dim // self.block, self.block, dtype, device)

    def update(self, start: int, keys: torch.Tensor) -> torch.Tensor:
        """Write keys [B, T, D] at positions start.. and return all filled keys as fp32 [B, start+T, D]."""
        B, T, D = keys.shape
        self.rows.write(start, keys.view(B, T, D // self.block, self.block).transpose(1, 2))
        full = self.rows.read(start + T)  # [B, blocks, S, block]
        return full.transpose(1, 2).reshape(B, start + T, D)


class KeptPools:
    """The keys of the first complete pools of P tokens: `keys` [B, n, Di] for the op-by-op layer (None: none yet;
    kept only for unpadded calls, where pools start at position 0), and for the fused step `fused` [>= n, Di]
    with its count `fused_done` [1] int64, which the kernel advances."""

    def __init__(self, pool: int, dim: int, device: str | torch.device = "cpu"):
        self.pool, self.dim = pool, dim
        self.keys: torch.Tensor | None = None
        self.fused = torch.zeros(0, dim, device=device)
        self.fused_done = torch.zeros(1, dtype=torch.long, device=device)

    def fused_room(self, pools: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`fused` with room for `pools` keys (grown by doubling, the kept ones copied) and `fused_done`."""
        if self.fused.shape[0] < pools:
            grown = self.fused.new_zeros(max(pools, 2 * self.fused.shape[0]), self.dim)
            grown[:self.fused.shape[0]] = self.fused
            self.fused = grown
        return self.fused, self.fused_done

    def trim(self, offset: int) -> None:
        """Forget the pools that reach position `offset` or beyond."""
        keep = offset // self.pool
        if self.keys is not None and self.keys.shape[1] > keep:
            self.keys = self.keys[:, :keep] if keep else None
        self.fused_done.clamp_(max=keep)

    def nbytes(self) -> int:
        return self.fused.nbytes + (0 if self.keys is None else self.keys.nbytes)


class DSACache:
    """One DSA layer's cache: `latent` (LatentCache) and `index` (IndexKeyCache), trimmed together; `pools`
    (k-pool indexers: `pool` > 0) the kept keys of complete pools."""

    paged = True

    def __init__(self, batch: int, max_len: int, row_dim: int, index_dim: int, dtype: str = "float32",
                 device: str | torch.device = "cpu", pool: int = 0):
        self.latent = LatentCache(batch, max_len, row_dim, dtype, device)
        self.index = IndexKeyCache(batch, max_len, index_dim, dtype, device)
        self.pools = KeptPools(pool, index_dim // 2, device) if pool else None

    def bytes_per_token(self) -> int:
        return self.latent.bytes_per_token() + self.index.bytes_per_token()

    def trim(self, offset: int) -> None:
        self.latent.trim(offset)
        self.index.trim(offset)
        if self.pools is not None:
            self.pools.trim(offset)

    def nbytes(self) -> int:
        return self.latent.nbytes() + self.index.nbytes() + (0 if self.pools is None else self.pools.nbytes())
