"""Caches for the layer kinds that are not plain K/V: MLA's latent rows and delta-rule state.

Both follow the `LayerCache` protocol of engine/cache.py (`trim(offset)`, `nbytes()`).

- `LatentCache` (MLA): one row per token holding the normalised KV latent and the shared
  "rope" key part, kv_lora_rank + qk_rope_head_dim values, in a `PagedBuffer` (blocks
  allocated as the context grows; float32, bfloat16 or fp8 rows) like `KVCache`.
- `DeltaStateCache` (KDA / Gated DeltaNet): the fp32 recurrent state [B, H, K, V] and the
  short-conv tails (the last kernel-1 conv inputs) [B, kernel-1, C]. Its size does not
  grow with the context. It stays fp32 whatever the cache dtype: every token's update is
  decayed and added into the same state, so a rounding error per step would accumulate
  over the whole context instead of staying with one token's row, and the state is a
  constant, small part of the cache (K3: 0.46 GB in all at any length).

Trim semantics of `DeltaStateCache`: the state is a running sum in which every token's
contribution is mixed into every later one, so it cannot be rolled back by subtraction.
`trim(offset)` therefore succeeds only when
  - `offset >= self.offset` (nothing to forget: a no-op),
  - `offset == 0` (reset to the empty state), or
  - a snapshot taken with `snapshot()` at exactly `offset` exists (restored by copy);
otherwise it raises `StateRollbackError`. A caller that wants to reuse a shared prompt
prefix takes a snapshot after prefilling that prefix (one copy of the state per snapshot).
"""

from __future__ import annotations

import torch

from localmoe.engine.cache import PagedBuffer
from localmoe.errors import LocalMoEError


class StateRollbackError(LocalMoEError):
    """A recurrent-state cache was asked to forget tokens it cannot forget."""


class LatentCache:
    """MLA rows of one layer, paged: [B, S, D] with D = kv_lora_rank + qk_rope_head_dim per token."""

    paged = True  # releases blocks on trim: ModelCache trims it after the layers that may refuse

    def __init__(self, batch: int, max_len: int, dim: int, dtype: str = "float32",
                 device: str | torch.device = "cpu"):
        # fp8: one scale per row (K3: 4 bytes on 576, 0.7 %). e4m3 keeps 3 significant bits for
        # values down to amax * 2^-6 / 448, so the rope part keeps its precision unless it is
        # ~10^4 times smaller than the latent's largest value.
        self.rows = PagedBuffer(batch, max_len, 1, dim, dtype, device)

    def update(self, start: int, rows: torch.Tensor) -> torch.Tensor:
        """Write rows [B, T, D] at positions start.. and return all filled rows as fp32 [B, start+T, D]."""
        self.rows.write(start, rows.unsqueeze(1))
        return self.rows.read(start + rows.shape[1]).squeeze(1)

    def bytes_per_token(self) -> int:
        """Bytes one token costs in one sequence of this layer (fp8: values + the fp32 scale)."""
        return self.rows.bytes_per_token()

    @property
    def records(self) -> bool:
        """Whether a verify must `record` (a bf16 / fp8 cache's exact ring: PagedBuffer.record)."""
        return self.rows.lossy

    def record(self, on: bool) -> None:
        self.rows.record(on)

    def trim(self, offset: int) -> None:
        self.rows.trim(offset)

    def nbytes(self) -> int:
        return self.rows.nbytes()


class DeltaStateCache:
    """Recurrent state [B, H, K, V] (fp32) + conv tails [B, kernel-1, C] of one delta-rule layer."""

    records = True  # a verify records the states it passes (engine/spec/verify.py)

    def __init__(self, batch: int, heads: int, key_dim: int, value_dim: int, conv_channels: int, conv_kernel: int,
                 device: str | torch.device = "cpu"):
        self.state = torch.zeros(batch, heads, key_dim, value_dim, dtype=torch.float32, device=device)
        self.conv_tail = torch.zeros(batch, conv_kernel - 1, conv_channels, dtype=torch.float32, device=device)
        self.offset = 0  # tokens folded into the state
        self._snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._recording: set[int] | None = None  # while recording: the snapshot offsets held before

    def record(self, on: bool) -> None:
        """While on, every `advance` keeps the state it leaves as a snapshot (no copy), so `trim` can return
        to any position reached since (a speculative verify rolls back to its last accepted token); off
        forgets the snapshots made while on, keeping the ones from before."""
        if on:
            self._recording = set(self._snapshots)
        elif self._recording is not None:
            self._snapshots = {k: v for k, v in self._snapshots.items() if k in self._recording}
            self._recording = None

    @property
    def recording(self) -> bool:
        """Whether `record` is on (every `advance` keeps its state)."""
        return self._recording is not None

    def advance(self, state: torch.Tensor, conv_tail: torch.Tensor, tokens: int) -> None:
        """Take the state [B, H, K, V] and conv tail after `tokens` more tokens (held, not copied)."""
        if state.shape != self.state.shape or conv_tail.shape != self.conv_tail.shape:
            raise ValueError(f"state {tuple(state.shape)} / conv tail {tuple(conv_tail.shape)} do not match the "
                             f"cache's {tuple(self.state.shape)} / {tuple(self.conv_tail.shape)}")
        self.state = state.float()
        self.conv_tail = conv_tail.float()
        self.offset += tokens
        if self._recording is not None:  # held as given: the mixers hand over new tensors each step
            self._snapshots[self.offset] = (self.state, self.conv_tail)

    def snapshot(self, keep_earlier: bool = True) -> int:
        """Remember the current state so that `trim(offset)` can return to it; returns that offset.
        `keep_earlier=False` drops the snapshots taken before (one copy of the state in all)."""
        if not keep_earlier:
            self._snapshots.clear()
        self._snapshots[self.offset] = (self.state.clone(), self.conv_tail.clone())
        return self.offset

    def trim(self, offset: int) -> None:
        """Forget tokens at or after `offset`: a no-op, a reset to 0, or a snapshot restore (see module doc)."""
        if offset >= self.offset:
            return
        # new tensors, not in-place writes: the state was made under inference mode, a trim may run outside it
        if offset == 0:
            self.state, self.conv_tail = torch.zeros_like(self.state), torch.zeros_like(self.conv_tail)
        elif offset in self._snapshots:
            state, tail = self._snapshots[offset]
            self.state, self.conv_tail = state.clone(), tail.clone()
        else:
            raise StateRollbackError(
                f"cannot roll a delta-rule state back from {self.offset} to {offset} tokens: the recurrent state "
                f"has no per-token history (snapshots at {sorted(self._snapshots) or 'none'}); re-run the prompt "
                "from the start, or snapshot() the cache at the prefix you mean to reuse")
        self.offset = offset
        self._snapshots = {k: v for k, v in self._snapshots.items() if k <= offset}

    def rollback_point(self, limit: int) -> int:
        """The largest offset <= `limit` that `trim` can return to (0 always works)."""
        if self.offset <= limit:
            return self.offset
        return max((k for k in self._snapshots if k <= limit), default=0)

    def nbytes(self) -> int:
        snapshots = sum(s.nbytes + t.nbytes for s, t in self._snapshots.values())
        return self.state.nbytes + self.conv_tail.nbytes + snapshots
