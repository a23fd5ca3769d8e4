"""One cache protocol for every layer kind (state, offset, trim), with paged storage for attention.

`ModelCache` owns one per-layer cache object and the shared bookkeeping: how many
positions are filled (`offset`) and, for left-padded batches, which slots hold real
tokens (`key_mask`). Attention layers use `KVCache`, MLA layers `LatentCache`
(state_cache.py), delta-rule layers `DeltaStateCache`; all implement `LayerCache`.

Attention-type caches store token rows in a `PagedBuffer`: fixed blocks of `BLOCK_TOKENS`
tokens allocated as the context grows (a 1M-token `max_len` costs nothing up front) and
a block table per sequence mapping its logical blocks to physical blocks of one pool.
Rows are stored as "float32", "bfloat16" or "fp8" (float8_e4m3fn with one fp32 scale per
token and head, `quantize_fp8`) and dequantised to fp32 on read, filled positions only.
A bf16 or fp8 buffer also keeps its last `EXACT_RECENT` positions exactly (fp32, a ring of
constant size): the newest tokens draw most of the attention (sliding-window layers see
nothing else), so rounding them costs the most; a 1M-token context pays 32 rows per layer.
"""

from __future__ import annotations

import copy
import heapq
from typing import Protocol

import torch

from localmoe.config import KV_CACHE_DTYPES
from localmoe.kernels.fp8_cache import dequantize_fp8, quantize_fp8
from localmoe.kernels.gqa_decode import PagedKV

STORAGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}
BLOCK_TOKENS = 256  # tokens per physical block (read at construction, so tests can shrink it)
# Positions a bf16/fp8 buffer also keeps in fp32. Measured on the tiny gpt-oss (sliding window 4):
# fp8 everywhere moves the logits by up to 59% of their range and flips 5 of 64 greedy tokens;
# keeping the last 16 exact brings it to 0.02% and 0 flips (32 gives margin for longer windows).
EXACT_RECENT = 32


class LayerCache(Protocol):
    def trim(self, offset: int) -> None:
        """Forget everything at or after position `offset`."""

    def nbytes(self) -> int:
        """Bytes this layer's cache holds (allocated)."""


class PagedBuffer:
    """Rows of H x D values per token for `batch` sequences of up to `max_len` tokens, in fixed blocks.

    The pool is one tensor [H, P, block, D] (head-major, so one head's positions are contiguous
    rows, as attention kernels read them) that grows (doubling, capped at what `max_len` needs)
    when a block is needed and none is free; `table[b]` lists sequence b's physical blocks in
    order; the first block is allocated at construction. `trim` returns whole blocks past the
    offset to a free list (smallest id reused first). While the table is the identity (batch 1,
    blocks 0, 1, 2, ...) a read is a view of the pool, so an fp32 decode step copies nothing;
    otherwise a read gathers the blocks (one `index_select`).
    """

    def __init__(self, batch: int, max_len: int, heads: int, dim: int, dtype: str = "float32",
                 device: str | torch.device = "cpu"):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"cache dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {dtype!r}")
        self.batch, self.max_len, self.heads, self.dim, self.dtype = batch, max_len, heads, dim, dtype
        self.block = max(1, min(BLOCK_TOKENS, max_len))
        self.max_blocks = batch * -(-max_len // self.block)
        self.fp8 = dtype == "fp8"
        self.pool = torch.empty(heads, 0, self.block, dim, dtype=STORAGE_DTYPES[dtype], device=device)
        self.scales = torch.empty(heads, 0, self.block, device=device) if self.fp8 else None  # fp8: [H, P, block]
        # bf16/fp8: the newest positions also in fp32, ring slot = position % R; recent_pos[slot] = the
        # position the slot holds (-1: none), shared by the batch (every sequence writes the same positions)
        self.lossy = dtype != "float32"
        ring = min(EXACT_RECENT, max_len) if self.lossy else 0
        self.recent = torch.zeros(batch, heads, ring, dim, device=device)
        self.recent_pos = torch.full((ring,), -1, dtype=torch.long, device=device)
        self._ring_before: tuple[torch.Tensor, torch.Tensor] | None = None  # while recording (`record`)
        self.table: list[list[int]] = [[] for _ in range(batch)]
        self.free: list[int] = []  # heap of released physical blocks
        self.used = 0  # physical blocks ever handed out (ids 0 .. used-1)
        self.capacity = 0  # positions every sequence can hold without allocating
        self._index: torch.Tensor | None = None  # the table as [B, n] long, for gathers
        self._flat: tuple[torch.Tensor, torch.Tensor | None] | None = None  # identity table: [1, H, P*block, *]
        self._storage: tuple | None = None  # `storage`'s answer while the table is the identity
        self._paged: tuple[torch.Tensor, torch.Tensor] | None = None  # fp32, one sequence: (pool, table [n])
        self.generation = 0  # +1 whenever the pool or the tables change (what a caller's view of them checks)
        self._allocate(1)  # one block per sequence up front (at most BLOCK_TOKENS positions), the rest on demand

    def _allocate(self, tokens: int) -> None:
        """Give every sequence enough blocks for `tokens` positions."""
        need = -(-tokens // self.block) - len(self.table[0])
        new = max(0, need * self.batch - len(self.free))
        if self.used + new > self.pool.shape[1]:
            size = min(self.max_blocks, max(self.used + new, 2 * self.pool.shape[1]))
            self.pool = self._grow(self.pool, size)
            if self.fp8:
                self.scales = self._grow(self.scales, size)
        for _ in range(need):
            for row in self.table:
                if self.free:
                    row.append(heapq.heappop(self.free))
                else:
                    row.append(self.used)
                    self.used += 1
        self._reindex()

    @staticmethod
    def _grow(old: torch.Tensor, blocks: int) -> torch.Tensor:
        new = torch.empty(old.shape[0], blocks, *old.shape[2:], dtype=old.dtype, device=old.device)
        new[:, :old.shape[1]].copy_(old)
        return new

    def _reindex(self) -> None:
        self.generation += 1
        n = len(self.table[0])
        self.capacity = n * self.block
        self._index = torch.tensor(self.table, dtype=torch.long, device=self.pool.device)
        self._paged = None if self.lossy or self.batch != 1 else (self.pool, self._index[0])  # a new tuple per change
        if self.batch == 1 and self.table[0] == list(range(n)):
            H, P = self.heads, self.pool.shape[1]
            self._flat = (self.pool.view(1, H, P * self.block, self.dim),
                          self.scales.view(1, H, P * self.block) if self.fp8 else None)
            # what `storage` hands out, made once per change (a view costs ~2 us, a decode step asks per layer)
            self._storage = (self._flat[0][0], None if self._flat[1] is None else self._flat[1][0],
                             self.recent[0] if self.lossy else None, self.recent_pos if self.lossy else None)
        else:
            self._flat = self._storage = None

    def write(self, start: int, rows: torch.Tensor) -> None:
        """Store rows [B, H, T, D] at positions start .. start+T-1 of every sequence."""
        T = rows.shape[2]
        end = start + T
        self._ensure(end)
        scale = None
        if self.lossy:
            self._keep_recent(start, rows)
        if self.fp8:
            rows, scale = quantize_fp8(rows)
        if self._flat is not None:
            self._flat[0].narrow(2, start, T).copy_(rows)  # narrow + copy_: two cheap ops (decode is op-bound)
            if scale is not None:
                self._flat[1].narrow(2, start, T).copy_(scale)
            return
        for logical in range(start // self.block, (end - 1) // self.block + 1):
            lo, hi = max(start, logical * self.block), min(end, (logical + 1) * self.block)
            blocks, within = self._index[:, logical], slice(lo - logical * self.block, hi - logical * self.block)
            self.pool[:, blocks, within] = rows[:, :, lo - start:hi - start].transpose(0, 1).to(self.pool.dtype)
            if scale is not None:
                self.scales[:, blocks, within] = scale[:, :, lo - start:hi - start].transpose(0, 1)

    def flat_pool(self, end: int) -> torch.Tensor | None:
        """For kernels that write and read the cache in place: the pool as [1, H, capacity, D] with
        room for positions < `end` (allocated here), where the buffer is fp32 for one sequence and its
        table is the identity; None otherwise (then use write/read)."""
        if self.lossy or self.batch != 1:
            return None
        if end > self.capacity:
            self._ensure(end)
        return None if self._flat is None else self._flat[0]

    def storage(self, end: int) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None,
                                         torch.Tensor | None] | None:
        """For kernels that write and read the cache in place in its own dtype (kernels/fp8_cache `cache_rows`:
        the same quantisation on write, dequantisation and exact ring on read): (pool [H, capacity, D], fp8's
        scales [H, capacity], the exact ring [H, ring, D] and its positions [ring] (bf16 / fp8)) with room for
        positions < `end` (allocated here), where the buffer holds one sequence and its table is the identity;
        None otherwise (then use write/read)."""
        if self.batch != 1:
            return None
        if end > self.capacity:
            self._ensure(end)
        return self._storage

    def pages(self, end: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """For kernels that write and read the cache in place through its block table: the pool
        [H, P, block, D] and the sequence's table [n] long, with room for positions < `end` (allocated
        here), where the buffer is fp32 for one sequence; None otherwise (then use write/read)."""
        if end > self.capacity:
            self._ensure(end)
        return self._paged

    def _ensure(self, end: int) -> None:
        """Room for positions < `end` in every sequence (blocks allocated as needed)."""
        if end > self.capacity:
            if end > self.max_len:
                raise ValueError(f"positions up to {end} do not fit a cache of {self.max_len}")
            self._allocate(end)

    def _keep_recent(self, start: int, rows: torch.Tensor) -> None:
        """Copy the last rows of this write (at most the ring's size) into the exact ring."""
        ring, T = self.recent_pos.numel(), rows.shape[2]
        keep = min(T, ring)
        positions = torch.arange(start + T - keep, start + T, device=self.recent.device)
        self.recent[:, :, positions % ring] = rows[:, :, T - keep:].float()
        self.recent_pos[positions % ring] = positions

    def _exact_recent(self, out: torch.Tensor, length: int) -> torch.Tensor:
        """out [B, H, length, D] dequantised, with the positions the ring still holds put back exactly
        (a select, not a gather of the held ones: no data-dependent shape, so nothing waits for the device)."""
        ring = self.recent_pos.numel()
        positions = torch.arange(max(0, length - ring), length, device=out.device)
        slots = positions % ring
        held = (self.recent_pos[slots] == positions)[:, None]  # [n, 1]
        out[:, :, positions] = torch.where(held, self.recent[:, :, slots], out[:, :, positions])
        return out

    def read(self, length: int) -> torch.Tensor:
        """Positions 0 .. length-1 of every sequence as fp32 [B, H, length, D]."""
        if self._flat is not None:
            data = self._flat[0].narrow(2, 0, length)
            scale = self._flat[1].narrow(2, 0, length) if self.fp8 else None
        else:
            n = -(-length // self.block)
            index = self._index[:, :n].reshape(-1)
            data = self.pool.index_select(1, index).view(self.heads, self.batch, n * self.block, self.dim)
            data = data.transpose(0, 1).narrow(2, 0, length)
            if self.fp8:
                scale = self.scales.index_select(1, index).view(self.heads, self.batch, n * self.block)
                scale = scale.transpose(0, 1).narrow(2, 0, length)
        if self.fp8:
            return self._exact_recent(dequantize_fp8(data, scale), length)
        return self._exact_recent(data.float(), length) if self.lossy else data

    def record(self, on: bool) -> None:
        """bf16 / fp8: while on, keep the exact ring as it stood when recording began, so that `trim` can give the
        positions a verify's rejected drafts pushed out of it (a draft at p takes the slot of p - ring) their exact
        rows back, as a run without those drafts reads them. Nothing for fp32 (no ring)."""
        self._ring_before = (self.recent.clone(), self.recent_pos.clone()) if on and self.lossy else None

    def trim(self, offset: int) -> None:
        """Release whole blocks past `offset` (a partly filled block stays; its tail is overwritten). Nothing but
        a comparison where no block is past it and the buffer is fp32 (no exact ring: a verify's rejected drafts
        roll back every layer's K/V each time, and two tensor ops per buffer cost ~0.25 ms over 30 layers)."""
        if self.lossy:
            gone = self.recent_pos >= offset
            if self._ring_before is not None:  # the slots that held older positions before the recorded writes
                rows, positions = self._ring_before
                back = gone & (positions >= 0) & (positions < offset)
                self.recent[:, :, back] = rows[:, :, back]
                self.recent_pos[back] = positions[back]
                gone &= ~back
            self.recent_pos.masked_fill_(gone, -1)
        keep = -(-offset // self.block)
        if keep >= len(self.table[0]):
            return
        for row in self.table:
            for block in row[keep:]:
                heapq.heappush(self.free, block)
            del row[keep:]
        self._reindex()

    def copy(self, offset: int) -> PagedBuffer:
        """A new one-sequence buffer holding this one's positions < `offset` in blocks of its own: the blocks that
        cover them, gathered in order (an identity table), and the exact ring's entries for them (bf16 / fp8)."""
        if self.batch != 1:
            raise ValueError("only a one-sequence buffer is copied")
        keep = max(1, min(len(self.table[0]), -(-offset // self.block)))
        new = copy.copy(self)
        index = self._index[0, :keep]
        new.pool = self.pool.index_select(1, index)
        if self.fp8:
            new.scales = self.scales.index_select(1, index)
        new.recent = self.recent.clone()
        new.recent_pos = self.recent_pos.masked_fill(self.recent_pos >= offset, -1)
        new._ring_before = None  # a verify's record is this buffer's, not the copy's
        new.table, new.free, new.used = [list(range(keep))], [], keep
        new._reindex()
        return new

    def bytes_per_token(self) -> int:
        """Bytes one more position costs one sequence: values plus, for fp8, one fp32 scale per head
        (the exact ring of a bf16/fp8 buffer's newest positions is a constant, in `nbytes`)."""
        return self.heads * (self.dim * self.pool.element_size() + (4 if self.fp8 else 0))

    def nbytes(self) -> int:
        """Bytes of the blocks allocated so far (not of `max_len`), plus fp8's scales and the exact ring."""
        return self.pool.nbytes + self.recent.nbytes + (self.scales.nbytes if self.fp8 else 0)


class KVCache:
    """Keys/values of one attention layer, paged: H_kv rows of D values per token."""

    paged = True  # releases blocks on trim: ModelCache trims it after the layers that may refuse

    def __init__(self, batch: int, kv_heads: int, max_len: int, head_dim: int, dtype: str = "float32",
                 device: str | torch.device = "cpu"):
        # fp8: one scale per token and KV head (a head's D values share a magnitude; heads differ)
        self.keys = PagedBuffer(batch, max_len, kv_heads, head_dim, dtype, device)
        self.values = PagedBuffer(batch, max_len, kv_heads, head_dim, dtype, device)
        self._pages: tuple[tuple, tuple, PagedKV] | None = None  # `pages`' last answer and what it was made of

    def update(self, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, T, H_kv, D] at positions start.. and return all filled positions as
        fp32 [B, H_kv, start+T, D] (for an fp32 cache of one sequence: views of the pool)."""
        T = k.shape[1]
        self.keys.write(start, k.transpose(1, 2))
        self.values.write(start, v.transpose(1, 2))
        return self.keys.read(start + T), self.values.read(start + T)

    def decode_pools(self, pos: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The key and value pools [1, H_kv, capacity, D] (PagedBuffer.flat_pool) with room for position
        `pos`, for a fused decode step that writes it in place; None where the buffers cannot be."""
        keys = self.keys.flat_pool(pos + 1)
        values = self.values.flat_pool(pos + 1) if keys is not None else None
        return None if values is None else (keys, values)

    def pages(self, pos: int) -> PagedKV | None:
        """The pools and block tables (PagedBuffer.pages) with room for position `pos`, for a kernel that
        writes it in place (kernels/gqa_decode `gqa_decode_paged`); None where the buffers cannot be.
        The same object until the buffers grow or trim (it caches the kernel's view of them)."""
        keys = self.keys.pages(pos + 1)
        values = self.values.pages(pos + 1) if keys is not None else None
        if values is None:
            return None
        if self._pages is None or self._pages[0] is not keys or self._pages[1] is not values:
            self._pages = (keys, values, PagedKV(*keys, *values))
        return self._pages[2]

    def __getstate__(self) -> dict:
        """Pickled without `_pages`: the kernel's view of the pools holds their addresses (engine/swap.py)."""
        return {**self.__dict__, "_pages": None}

    @property
    def records(self) -> bool:
        """Whether a verify must `record` (a bf16 / fp8 cache's exact ring: PagedBuffer.record)."""
        return self.keys.lossy

    def record(self, on: bool) -> None:
        self.keys.record(on)
        self.values.record(on)

    def trim(self, offset: int) -> None:
        self.keys.trim(offset)
        self.values.trim(offset)

    def bytes_per_token(self) -> int:
        return self.keys.bytes_per_token() + self.values.bytes_per_token()

    def nbytes(self) -> int:
        return self.keys.nbytes() + self.values.nbytes()


class ModelCache:
    """All layers' caches plus the filled length and the padding mask of the batch; `device` is the model's
    (where its steps' positions and masks are made), each layer's cache is on its own layer's device."""

    def __init__(self, layers: list[LayerCache], batch: int, max_len: int, device: str | torch.device = "cpu"):
        self.layers = layers
        # the layers that keep what a verify's rollback needs while recording (engine/spec/verify.py): delta-rule
        # states per position, a bf16 / fp8 cache's exact ring as it stood
        self.recorders = [layer for layer in layers if getattr(layer, "records", False)]
        # trim's order: the paged layers after the ones that may refuse (a delta-rule state), fixed at construction
        self._trim_order = sorted(layers, key=lambda layer: getattr(layer, "paged", False))
        self.batch = batch
        self.max_len = max_len
        self.device = torch.device(device)
        self.offset = 0
        # key_mask[b, s] is False for left-padding slots; None while no row is padded.
        self.key_mask: torch.Tensor | None = None
        # MRoPE (Qwen3-VL): the rotary position of a text token at cache position p is p + rope_delta once a
        # prompt's images have run (their grid positions take fewer positions than tokens); 0 otherwise
        self.rope_delta = 0
        # sink(start, tokens [T], hidden [T, D], settled): told the final-norm hidden states of the positions each
        # forward writes (batch 1; settled: not a verify's rows; an MTP drafter reads them, engine/spec/mtp.py)
        self.hidden_sink = None

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
            self.key_mask = torch.ones(self.batch, self.max_len, dtype=torch.bool, device=self.device)
        self.key_mask[:, self.offset:self.offset + new_tokens] = True if mask is None else mask

    def advance(self, new_tokens: int) -> None:
        self.offset += new_tokens

    def trim(self, offset: int) -> None:
        """Roll back to `offset` positions (e.g. to reuse a shared prompt prefix).

        Layers are trimmed before the offset moves, so a layer that refuses (a delta-rule
        state cannot be rolled back to an arbitrary position) leaves the offset unchanged.
        """
        target = min(self.offset, offset)
        for layer in self._trim_order:  # paged ones last
            layer.trim(target)
        self.offset = target

    def rollback_point(self, limit: int) -> int:
        """The longest prefix, at most `limit` positions, that `trim` can keep: any position for paged
        layers; for delta-rule states only where they hold a snapshot (or the start)."""
        point = min(limit, self.offset)
        while True:
            lower = min((layer.rollback_point(point) for layer in self.layers if hasattr(layer, "rollback_point")),
                        default=point)
            if lower == point:
                return point
            point = lower

    def copy(self, offset: int) -> ModelCache:
        """A new batch-1 cache holding this one's first `offset` positions (a point `rollback_point` allows),
        sharing no tensor with it: each paged buffer copies only the blocks that cover them (`PagedBuffer.copy`),
        every other layer state (delta-rule states and their snapshots, kept pools) is copied whole and trimmed.
        The prefix cache hands one entry to several prompts this way (engine/prefix_cache.py)."""
        if self.batch != 1 or self.key_mask is not None:
            raise ValueError("only an unpadded one-sequence cache is copied")
        memo = {id(buffer): buffer.copy(offset) for buffer in _paged_buffers(self.layers)}
        sink, self.hidden_sink = self.hidden_sink, None  # a drafter's callback is not copied (the taker sets its own)
        try:
            with torch.inference_mode(False):  # plain tensors, as `new_cache` makes them
                new = copy.deepcopy(self, memo)
        finally:
            self.hidden_sink = sink
        new.trim(offset)
        return new

    def snapshot(self, keep_earlier: bool = True) -> None:
        """Let `trim` return to the current offset later (delta-rule states copy themselves; K/V need nothing)."""
        for layer in self.layers:
            if hasattr(layer, "snapshot"):
                layer.snapshot(keep_earlier)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def _paged_buffers(objects: list) -> list[PagedBuffer]:
    """The `PagedBuffer`s reachable from `objects` (layer caches and the objects they hold)."""
    found, seen, stack = [], set(), list(objects)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, torch.Tensor):
            continue
        seen.add(id(obj))
        if isinstance(obj, PagedBuffer):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found
