"""One cache protocol for every layer kind (state, offset, trim), preallocated up front.

`ModelCache` owns one per-layer cache object and the shared bookkeeping: how many
positions are filled (`offset`) and, for left-padded batches, which slots hold real
tokens (`key_mask`). Attention layers use `KVCache`; later layer kinds (MLA latent,
delta-rule state) implement the same `LayerCache` protocol.
"""

from __future__ import annotations

from typing import Protocol

import torch


class LayerCache(Protocol):
    def trim(self, offset: int) -> None:
        """Forget everything at or after position `offset`."""

    def nbytes(self) -> int:
        """Bytes this layer's cache holds (allocated)."""


class KVCache:
    """Preallocated keys/values of one attention layer: [B, H_kv, S_max, D] each."""

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype=torch.float32):
        # torch.empty does not touch the pages: the OS commits memory only as the context grows.
        self.keys = torch.empty(batch, kv_heads, max_len, head_dim, dtype=dtype)
        self.values = torch.empty(batch, kv_heads, max_len, head_dim, dtype=dtype)

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H_kv, T, D] at positions start.. and return views of all filled positions."""
        T = k.shape[2]
        self.keys.narrow(2, start, T).copy_(k)  # narrow + copy_: two cheap ops (decode is op-bound)
        self.values.narrow(2, start, T).copy_(v)
        return self.keys.narrow(2, 0, start + T), self.values.narrow(2, 0, start + T)

    def trim(self, offset: int) -> None:
        pass  # slots past the offset are simply overwritten

    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class ModelCache:
    """All layers' caches plus the filled length and the padding mask of the batch."""

    def __init__(self, layers: list[LayerCache], batch: int, max_len: int):
        self.layers = layers
        self.batch = batch
        self.max_len = max_len
        self.offset = 0
        # key_mask[b, s] is False for left-padding slots; None while no row is padded.
        self.key_mask: torch.Tensor | None = None

    def reserve(self, new_tokens: int) -> int:
        """Check that `new_tokens` more positions fit; return the start position."""
        if self.offset + new_tokens > self.max_len:
            from localmoe.errors import LocalMoEError

            raise LocalMoEError(f"context overflow: {self.offset} cached + {new_tokens} new tokens exceed the "
                                f"context of {self.max_len}; start a new conversation or raise --max-context")
        return self.offset

    def append_mask(self, mask: torch.Tensor | None, new_tokens: int) -> None:
        """Record which of the `new_tokens` slots are real (mask [B, T]) before a forward pass."""
        if mask is None and self.key_mask is None:
            return
        if self.key_mask is None:
            self.key_mask = torch.ones(self.batch, self.max_len, dtype=torch.bool)
        self.key_mask[:, self.offset:self.offset + new_tokens] = True if mask is None else mask

    def advance(self, new_tokens: int) -> None:
        self.offset += new_tokens

    def trim(self, offset: int) -> None:
        """Roll back to `offset` positions (e.g. to reuse a shared prompt prefix).

        Layers are trimmed before the offset moves, so a layer that refuses (a delta-rule
        state cannot be rolled back to an arbitrary position) leaves the offset unchanged.
        """
        target = min(self.offset, offset)
        for layer in self.layers:
            layer.trim(target)
        self.offset = target

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)
