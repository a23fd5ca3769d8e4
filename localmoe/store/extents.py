"""Byte layouts of the packed store's data files, and the checksum they carry.

An expert extent holds every tensor of one expert at the fixed offsets of an
`ExpertLayout`. Extents start on 4096-byte boundaries and are padded with zeros to a
multiple of 4096 bytes (the layout's `slot_bytes`), so ONE aligned read, O_DIRECT
included, fetches a whole expert, and every expert of a layout fills a slot of the same
size. Dense shards are plain safetensors files whose header is computed from names,
dtypes and shapes alone (`dense_shard_header`), so the data can follow it tensor by
tensor. See docs/store-format.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from localmoe.store.safetensors import DTYPES
from localmoe.store.safetensors_writer import TensorEntry, alignment_order, header_bytes

ALIGN = 4096  # extent alignment and slot granularity: the block size O_DIRECT reads need
PART_ALIGN = 256  # each tensor inside an extent: cudaMalloc's alignment, enough for any vector load
CHECKSUM = "xxh3_64"  # xxHash XXH3 64-bit, seed 0, as 16 lowercase hex digits

DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


def align_up(n: int, alignment: int = ALIGN) -> int:
    """The smallest multiple of `alignment` that is >= n."""
    return -(-n // alignment) * alignment


def checksum(data) -> str:
    """xxh3_64 (seed 0) of a bytes-like object, as 16 lowercase hex digits."""
    return xxhash.xxh3_64_hexdigest(data)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of `t` (row-major, little-endian) as a uint8 array; no copy for a contiguous CPU tensor."""
    t = t.detach().to("cpu").contiguous()
    if t.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    return t.reshape(-1).view(torch.uint8).numpy()


def nbytes_of(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


class LayoutPart(NamedTuple):
    """One tensor of an extent: `offset` counts from the start of the extent."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class ExpertLayout:
    """Where each tensor of an expert lies inside its extent; `slot_bytes` is the extent's size."""

    parts: tuple[LayoutPart, ...]
    slot_bytes: int

    @classmethod
    def for_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ExpertLayout:
        """The layout for one expert's tensors, in their order, each at a PART_ALIGN boundary."""
        if not tensors:
            raise ValueError("an expert needs at least one tensor")
        parts, offset = [], 0
        for name, t in tensors.items():
            if t.dtype not in DTYPE_NAMES:
                raise ValueError(f"tensor {name!r} has dtype {t.dtype}, which the store cannot hold")
            offset = align_up(offset, PART_ALIGN)
            shape = tuple(t.shape)
            parts.append(LayoutPart(name, t.dtype, shape, offset, nbytes_of(t.dtype, shape)))
            offset += parts[-1].nbytes
        return cls(tuple(parts), max(ALIGN, align_up(offset)))

    @property
    def payload_bytes(self) -> int:
        """Bytes up to the end of the last tensor; the rest of the slot is zero padding."""
        return max(p.offset + p.nbytes for p in self.parts)

    def names(self) -> list[str]:
        return [p.name for p in self.parts]

    def check(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError naming the first tensor that does not fit this layout."""
        if set(tensors) != {p.name for p in self.parts}:
            missing = sorted({p.name for p in self.parts} - set(tensors))
            extra = sorted(set(tensors) - {p.name for p in self.parts})
            raise ValueError(f"has tensors that differ from the layer's first expert (missing {missing}, "
                             f"extra {extra})")
        for p in self.parts:
            t = tensors[p.name]
            if t.dtype != p.dtype or tuple(t.shape) != p.shape:
                raise ValueError(f"tensor {p.name!r} is {DTYPE_NAMES.get(t.dtype, t.dtype)} {list(t.shape)}, but "
                                 f"the layer's first expert has {DTYPE_NAMES[p.dtype]} {list(p.shape)}")

    def pack(self, tensors: Mapping[str, torch.Tensor], out: np.ndarray) -> None:
        """Write one expert's tensors (already `check`ed) into `out` (uint8, slot_bytes), zeroing the gaps."""
        end = 0
        for p in self.parts:
            out[end:p.offset] = 0
            out[p.offset:p.offset + p.nbytes] = tensor_bytes(tensors[p.name])
            end = p.offset + p.nbytes
        out[end:self.slot_bytes] = 0

    def views(self, buf: np.ndarray | torch.Tensor) -> dict[str, torch.Tensor]:
        """Zero-copy tensors over one extent held in `buf` (uint8, at least payload_bytes): a numpy
        array (a RAM slot) or a tensor on any device (a GPU slot)."""
        data = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else buf
        out = {}
        for p in self.parts:
            if p.nbytes == 0:
                out[p.name] = torch.empty(p.shape, dtype=p.dtype, device=data.device)
            else:
                out[p.name] = data[p.offset:p.offset + p.nbytes].view(p.dtype).reshape(p.shape)
        return out

    def to_dict(self) -> dict:
        return {"slot_bytes": self.slot_bytes,
                "parts": [{"name": p.name, "dtype": DTYPE_NAMES[p.dtype], "shape": list(p.shape),
                           "offset": p.offset, "nbytes": p.nbytes} for p in self.parts]}

    @classmethod
    def from_dict(cls, data: object) -> ExpertLayout:
        """Parse and check a layout record; raises ValueError saying what is wrong."""
        if not isinstance(data, dict) or type(data.get("slot_bytes")) is not int or not isinstance(
                data.get("parts"), list) or not data["parts"]:
            raise ValueError("needs an integer slot_bytes and a non-empty list of parts")
        slot = data["slot_bytes"]
        if slot <= 0 or slot % ALIGN:
            raise ValueError(f"slot_bytes {slot} is not a positive multiple of {ALIGN}")
        parts, end, names = [], 0, set()
        for i, part in enumerate(data["parts"]):
            try:
                name, dtype, shape = part["name"], DTYPES[part["dtype"]], tuple(part["shape"])
                offset, nbytes = part["offset"], part["nbytes"]
            except (TypeError, KeyError):
                raise ValueError(f"part {i} needs name, a known dtype, shape, offset and nbytes") from None
            if not isinstance(name, str) or name in names or not all(type(s) is int and s >= 0 for s in shape):
                raise ValueError(f"part {i} has a repeated or bad name or a bad shape")
            if type(offset) is not int or type(nbytes) is not int or offset < end or offset % PART_ALIGN:
                raise ValueError(f"part {name!r} has offset {offset!r}: parts must be in order, not overlap "
                                 f"and start at multiples of {PART_ALIGN}")
            if nbytes != nbytes_of(dtype, shape) or offset + nbytes > slot:
                raise ValueError(f"part {name!r} has nbytes {nbytes}, which does not match its dtype and shape "
                                 f"or runs past slot_bytes {slot}")
            names.add(name)
            parts.append(LayoutPart(name, dtype, shape, offset, nbytes))
            end = offset + nbytes
        return cls(tuple(parts), slot)


class DenseEntry(NamedTuple):
    """A dense tensor placed in a shard: `offset` is absolute in the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def dense_shard_header(entries: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> tuple[bytes, list[DenseEntry]]:
    """The safetensors preamble + header for `entries`, and where each tensor's bytes go.

    Tensors are placed widest dtype first (stable), so each offset is a multiple of its
    itemsize without gaps (the official reader rejects gaps); the JSON is padded with
    spaces so the data starts on an ALIGN boundary.
    """
    ordered = alignment_order([TensorEntry(name, DTYPE_NAMES[dtype], tuple(shape)) for name, dtype, shape in entries])
    head = header_bytes(ordered, {"format": "pt"}, align=ALIGN)
    dtypes = {name: dtype for name, dtype, _ in entries}
    placed, offset = [], len(head)
    for entry in ordered:
        placed.append(DenseEntry(entry.name, dtypes[entry.name], entry.shape, offset, entry.nbytes))
        offset += entry.nbytes
    return head, placed