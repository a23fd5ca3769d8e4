"""Byte-level helpers the ggml block decoders share (quant/ggml.py, quant/ggml_iq.py): aligned views of
block bytes, their float16 fields, bit fields unpacked four bytes at a time, and the decoders' lookup tables
on the blocks' device (a GPU tier's experts are decoded where they are)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

_COPIES: dict[tuple[int, torch.device], torch.Tensor] = {}


def on(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A module-level lookup table (alive for the process) on `device`: copied there once, then reused."""
    if table.device == device:
        return table
    key = (id(table), device)
    if key not in _COPIES:
        _COPIES[key] = table.to(device)
    return _COPIES[key]


def aligned(t: torch.Tensor, align: int) -> torch.Tensor:
    """`t` contiguous at a storage offset divisible by `align`, as `Tensor.view(dtype)` requires."""
    if t.is_contiguous() and t.storage_offset() % align == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)  # a fresh storage, offset 0


def f16_fields(blocks: torch.Tensor, start: int, count: int = 1) -> torch.Tensor:
    """`count` adjacent float16 fields from byte `start` of each block, as float32 `[N, count]`."""
    return aligned(blocks[:, start:start + 2 * count], 2).view(torch.float16).to(torch.float32)


def u16_fields(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` adjacent little-endian uint16 fields from byte `start` of each block, as int32 `[N, count]`."""
    return aligned(blocks[:, start:start + 2 * count], 2).view(torch.int16).to(torch.int32) & 0xFFFF


def u32_fields(blocks: torch.Tensor, start: int, count: int) -> torch.Tensor:
    """`count` adjacent uint32 fields from byte `start` of each block, as int32 `[N, count]` (the same bits:
    shift right, then mask, to read a field without the sign)."""
    return aligned(blocks[:, start:start + 4 * count], 4).view(torch.int32)


def bit_fields(field: torch.Tensor, shifts: Sequence[int], mask: int) -> torch.Tensor:
    """Bit fields of packed bytes: `[N, G, B]` uint8 -> `[N, G, len(shifts), B]` uint8.

    Output `[n, g, i, b]` is `(field[n, g, b] >> shifts[i]) & mask`. The work is done on
    int32 words (B must be a multiple of 4; four bytes per op, so ~4x fewer elements than
    per-byte ops); the masks clear whatever an arithmetic shift drags in from above.
    Assumes a little-endian host, as ggml does.
    """
    words = aligned(field, 4).view(torch.int32)  # [N, G, B / 4]
    word_mask = mask * 0x01010101  # `mask` in each of the 4 bytes
    parts = [(words >> s if s else words) & word_mask for s in shifts]
    return torch.stack(parts, dim=2).view(torch.uint8)  # [N, G, S, B]
