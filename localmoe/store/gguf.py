"""GGUF checkpoints: the header parsed here in one `struct` pass, tensor data as views of an mmap.

The header (version, metadata key/values, tensor infos) is read in one pass over the mapped
file, every length bounded by the file size, so a truncated or corrupt file gets a message
naming the field and byte instead of an opaque numpy error. We do not use `gguf.GGUFReader`:
it builds ~10^6 numpy memmap slices for a 49k-token vocabulary and takes ~5 s to open
SmolLM2-135M; this parser takes ~0.1 s. The `gguf` package still supplies the constants.

Shapes are reported in PyTorch order, outermost first: the reverse of ggml's `ne`.
"""

from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from gguf import (
    GGML_QUANT_SIZES,
    GGUF_DEFAULT_ALIGNMENT,
    GGMLQuantizationType,
    GGUFValueType,
)

from localmoe.errors import CheckpointError
from localmoe.quant.ggml import dequantize
from localmoe.store.mapped import MappedFile

V = GGUFValueType
_SCALAR_FORMATS = {V.UINT8: "B", V.INT8: "b", V.UINT16: "H", V.INT16: "h", V.UINT32: "I", V.INT32: "i",
                   V.FLOAT32: "f", V.BOOL: "?", V.UINT64: "Q", V.INT64: "q", V.FLOAT64: "d"}
_MAGIC = b"GGUF"
_VERSIONS = (2, 3)  # version 1 had 32-bit counts and lengths; llama.cpp dropped it too


@dataclass(frozen=True, slots=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file. `shape` is PyTorch order; `offset` is absolute in the file."""

    name: str
    ggml_type: GGMLQuantizationType
    shape: tuple[int, ...]
    nbytes: int
    offset: int


class _Corrupt(Exception):
    """Raised inside `_HeaderParser`; becomes a CheckpointError naming the file."""


class _HeaderParser:
    """Decodes the GGUF header fields in order, never past the end of the file."""

    def __init__(self, buf: mmap.mmap, order: str) -> None:
        self.buf, self.order, self.pos, self.size = buf, order, 0, len(buf)
        self._u64 = struct.Struct(order + "Q").unpack_from

    def take(self, n: int, what: str) -> int:
        if n < 0 or self.pos + n > self.size:
            raise _Corrupt(f"{what} at byte {self.pos} needs {n} bytes but the file ends at byte {self.size}")
        start, self.pos = self.pos, self.pos + n
        return start

    def u32(self, what: str) -> int:
        return struct.unpack_from(self.order + "I", self.buf, self.take(4, what))[0]

    def u64(self, what: str) -> int:
        return self._u64(self.buf, self.take(8, what))[0]

    def string(self, what: str) -> str:
        n = self.u64(what)
        start = self.take(n, what)
        return self.buf[start:start + n].decode("utf-8", "replace")

    def value(self, vtype: int, what: str) -> Any:
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is not None:
            return struct.unpack_from(self.order + fmt, self.buf, self.take(struct.calcsize(fmt), what))[0]
        if vtype == V.STRING:
            return self.string(what)
        if vtype == V.ARRAY:
            return self.array(what)
        raise _Corrupt(f"{what} has unknown value type {vtype}")

    def array(self, what: str) -> list[Any]:
        itype, count = self.u32(what), self.u64(what)
        fmt = _SCALAR_FORMATS.get(itype)
        if fmt is not None:
            start = self.take(count * struct.calcsize(fmt), what)
            return list(struct.unpack_from(f"{self.order}{count}{fmt}", self.buf, start))
        min_size = {V.STRING: 8, V.ARRAY: 12}.get(itype)  # a length; an element type and a count
        if min_size is None:
            raise _Corrupt(f"{what} has elements of unknown value type {itype}")
        if count > (self.size - self.pos) // min_size:
            raise _Corrupt(f"{what} claims {count} elements, more than the file can hold")
        if itype == V.ARRAY:
            return [self.array(what) for _ in range(count)]
        return self._strings(count, what)

    def _strings(self, count: int, what: str) -> list[str]:
        # tokenizer vocabularies and merges: ~10^5 strings, so one tight loop over the map
        buf, unpack, pos, size = self.buf, self._u64, self.pos, self.size
        out: list[str] = []
        append = out.append
        for _ in range(count):
            if pos + 8 > size:
                break
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                break
            append(buf[pos + 8:end].decode("utf-8", "replace"))
            pos = end
        else:
            self.pos = pos
            return out
        raise _Corrupt(f"{what} runs past the end of the file ({size} bytes)")


def _byte_order(buf: mmap.mmap) -> str:
    if len(buf) >= 8 and struct.unpack_from("<I", buf, 4)[0] & 0xFFFF == 0:
        return ">"  # written on a big-endian host (the low half of a small version is zero)
    return "<"


def _parse_header(path: Path, buf: mmap.mmap) -> tuple[int, dict[str, Any], dict[str, GGUFTensorInfo]]:
    """(version, metadata, tensor infos) of a mapped GGUF file; CheckpointError unless it is sound."""
    if buf[:4] != _MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with the bytes 'GGUF')")
    h = _HeaderParser(buf, _byte_order(buf))
    try:
        h.take(4, "the magic")
        version = h.u32("the version")
        if version not in _VERSIONS:
            raise CheckpointError(f"{path} is GGUF version {version}, which localmoe cannot read (it reads "
                                  f"versions {' and '.join(map(str, _VERSIONS))}); convert the model again")
        n_tensors, n_kv = h.u64("the tensor count"), h.u64("the metadata count")
        metadata: dict[str, Any] = {}
        for i in range(n_kv):
            key = h.string(f"metadata key #{i}")
            if key in metadata:
                raise _Corrupt(f"metadata key {key!r} appears twice")
            vtype = h.u32(f"the type of {key!r}")
            if key == "general.alignment" and vtype != V.UINT32:
                raise _Corrupt(f"general.alignment has value type {vtype}, not UINT32 ({V.UINT32.value})")
            metadata[key] = h.value(vtype, f"the value of {key!r}")
        tensors = []
        for i in range(n_tensors):
            name = h.string(f"tensor name #{i}")
            n_dims = h.u32(f"the rank of {name!r}")
            ne = struct.unpack_from(f"{h.order}{n_dims}Q", buf, h.take(8 * n_dims, f"the shape of {name!r}"))
            raw_type, offset = h.u32(f"the type of {name!r}"), h.u64(f"the offset of {name!r}")
            tensors.append((name, ne, raw_type, offset))
    except _Corrupt as e:
        raise CheckpointError(f"{path} is truncated or corrupt: {e}; download it again") from None
    alignment = metadata.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if alignment == 0 or alignment & (alignment - 1):
        raise CheckpointError(f"{path}: general.alignment is {alignment}, not a power of two; the file is corrupt")
    data_start = -(-h.pos // alignment) * alignment  # tensor data starts at the next aligned byte
    return version, metadata, _tensor_infos(path, tensors, data_start, alignment, h.size)


def _tensor_infos(path: Path, tensors: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
                  alignment: int, size: int) -> dict[str, GGUFTensorInfo]:
    infos: dict[str, GGUFTensorInfo] = {}
    needed, first_cut = 0, None
    for name, ne, raw_type, offset in tensors:
        try:
            ggml_type = GGMLQuantizationType(raw_type)
            block_size, type_size = GGML_QUANT_SIZES[ggml_type]
        except (ValueError, KeyError):
            raise CheckpointError(f"{path}: tensor {name!r} has unknown ggml type {raw_type}; the file is "
                                  f"corrupt or newer than the installed gguf package") from None
        if ne and ne[0] % block_size:
            raise CheckpointError(f"{path}: tensor {name!r} has rows of {ne[0]} values, not a multiple of "
                                  f"its {block_size}-value blocks; the file is corrupt")
        if offset % alignment:
            raise CheckpointError(f"{path}: tensor {name!r} starts at data offset {offset}, not a multiple of "
                                  f"the file's {alignment}-byte alignment; the file is corrupt")
        if name in infos:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice; the file is corrupt")
        nbytes = math.prod(ne) // block_size * type_size
        infos[name] = GGUFTensorInfo(name, ggml_type, tuple(reversed(ne)), nbytes, data_start + offset)
        needed = max(needed, data_start + offset + nbytes)
        if data_start + offset + nbytes > size and first_cut is None:
            first_cut = name
    if needed > size:
        raise CheckpointError(f"{path} is truncated: expected at least {needed} bytes, found {size} "
                              f"(tensor {first_cut!r} is the first to run past the end); download it again")
    return infos


class GGUFFile(MappedFile):
    """A GGUF file: metadata as Python values, tensors as zero-copy views or dequantised tensors."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such GGUF file")
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < 4:
                    raise CheckpointError(f"{self.path} is not a GGUF file ({size} bytes)")
                # ACCESS_COPY: copy-on-write pages, so the numpy views are writable and torch.from_numpy
                # neither copies nor warns; writes stay private to this process
                self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        except OSError as e:
            raise CheckpointError(f"cannot read {self.path}: {e.strerror or e}") from None
        try:
            self.version, self.metadata, self._infos = _parse_header(self.path, self._map)
        except CheckpointError:
            self.close()
            raise

    @property
    def architecture(self) -> str:
        """general.architecture, e.g. "llama"."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise CheckpointError(f"{self.path} has no general.architecture string in its metadata")
        return arch

    def tensor_names(self) -> list[str]:
        """Tensor names, in file order."""
        return self.keys()

    @property
    def files(self) -> list[Path]:
        """The files holding the tensors: this one (a split model has several, store/gguf_split.py)."""
        return [self.path]

    def file_of(self, name: str) -> Path:
        """The file holding tensor `name`."""
        self.info(name)
        return self.path

    def info(self, name: str) -> GGUFTensorInfo:
        """Name, ggml type, PyTorch-order shape, stored byte count and absolute offset of one tensor."""
        return super().info(name)

    def raw(self, name: str) -> torch.Tensor:
        """The stored bytes as a zero-copy uint8 view, shape `[*outer dims, bytes per row]`."""
        info = self.info(name)
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        shape = (*info.shape[:-1], info.shape[-1] // block_size * type_size) if info.shape else (info.nbytes,)
        return self._bytes(name).reshape(shape)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The tensor dequantised to `dtype`, in PyTorch shape (F32 to float32 stays a zero-copy view)."""
        info = self.info(name)
        try:
            return dequantize(self.raw(name), info.ggml_type, info.shape, dtype)
        except CheckpointError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {e}") from None
