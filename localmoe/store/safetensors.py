"""safetensors checkpoints, read zero-copy through stdlib `mmap`.

File layout: `u64 little-endian N | N bytes of JSON header | data`. The header maps each
tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets relative to
the start of the data) plus an optional `"__metadata__": {str: str}`. Everything is
validated when the file is opened; tensors are views into a copy-on-write map
(`mmap.ACCESS_COPY`: writable for torch, never written back to the file).
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import struct
from pathlib import Path
from typing import NamedTuple

import torch

from localmoe.errors import CheckpointError
from localmoe.store.mapped import MappedFile

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool, "C64": torch.complex64,
}
# names the official writer uses for dtypes that only newer torch builds have
for _name, _attr in [("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu"),
                     ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")]:
    if hasattr(torch, _attr):
        DTYPES[_name] = getattr(torch, _attr)

_PREAMBLE = 8  # the u64 header length
_MAX_HEADER = 100_000_000  # the limit the reference implementation enforces


class TensorInfo(NamedTuple):
    """Where one tensor lives: `offset` is absolute in the file, `nbytes` its length."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    nbytes: int
    offset: int


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"key {dup!r} appears twice")
    return out


def _parse_header(path: Path, header: dict, data_start: int,
                  file_size: int) -> tuple[dict[str, str], dict[str, TensorInfo]]:
    """Validate a decoded header; returns (metadata, {name: TensorInfo}) or raises CheckpointError."""
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: the safetensors header is not a JSON object; the file is corrupt")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings; the file is corrupt")
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where} lacks dtype, shape or data_offsets; the file is corrupt")
        dtype = DTYPES.get(entry["dtype"])
        if dtype is None:
            raise CheckpointError(f"{where} has dtype {entry['dtype']!r}, which localmoe does not read "
                                  f"(known: {', '.join(DTYPES)})")
        shape, offsets = entry["shape"], entry["data_offsets"]
        if not (isinstance(shape, list) and all(type(s) is int and s >= 0 for s in shape)):
            raise CheckpointError(f"{where} has an invalid shape {shape!r}; the file is corrupt")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{where} has invalid data_offsets {offsets!r}; the file is corrupt")
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes:
            raise CheckpointError(f"{where} has data_offsets {offsets} ({end - begin} bytes) but dtype "
                                  f"{entry['dtype']} and shape {shape} need {nbytes} bytes; the file is corrupt")
        tensors[name] = TensorInfo(dtype, tuple(shape), nbytes, data_start + begin)
    needed = max((info.offset + info.nbytes for info in tensors.values()), default=data_start)
    if needed > file_size:
        first_cut = min((info.offset, name) for name, info in tensors.items()
                        if info.offset + info.nbytes > file_size)[1]
        raise CheckpointError(f"{path} is truncated: expected at least {needed} bytes, found {file_size} (tensor "
                              f"{first_cut!r} is the first to run past the end); download or write it again")
    ranges = sorted((info.offset, info.offset + info.nbytes, name) for name, info in tensors.items() if info.nbytes)
    for (_, prev_end, prev), (begin, _, name) in itertools.pairwise(ranges):
        if begin < prev_end:
            raise CheckpointError(f"{path}: the data of tensors {prev!r} and {name!r} overlap; the file is corrupt")
    return metadata, tensors


class SafetensorsFile(MappedFile):
    """One `.safetensors` file, memory-mapped; tensors are zero-copy views of the map."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"{self.path}: no such safetensors file")
        with open(self.path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            if file_size < _PREAMBLE:
                raise CheckpointError(f"{self.path} is not a safetensors file: {file_size} bytes, shorter than "
                                      f"the 8-byte header length")
            (header_len,) = struct.unpack("<Q", f.read(_PREAMBLE))
            if header_len > _MAX_HEADER:
                raise CheckpointError(f"{self.path} is not a safetensors file or is corrupt: its header claims "
                                      f"{header_len} bytes, more than the format's limit of {_MAX_HEADER}")
            if _PREAMBLE + header_len > file_size:
                raise CheckpointError(f"{self.path} is truncated or not a safetensors file: its header claims "
                                      f"{header_len} bytes but the whole file has {file_size}")
            raw_header = f.read(header_len)
            try:
                header = json.loads(raw_header, object_pairs_hook=_no_duplicates)
            except (UnicodeDecodeError, ValueError) as e:
                raise CheckpointError(f"{self.path}: the safetensors header is not valid JSON ({e}); "
                                      f"the file is corrupt") from None
            self.metadata, self._infos = _parse_header(self.path, header, _PREAMBLE + header_len, file_size)
            # ACCESS_COPY: writable (torch.from_numpy warns on read-only arrays), writes stay private
            self._map: mmap.mmap | None = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)

    def info(self, name: str) -> TensorInfo:
        """(dtype, shape, nbytes, absolute offset) of one tensor."""
        return super().info(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of the file map (copy-on-write: writes never reach the file)."""
        info = self.info(name)
        return self._bytes(name).view(info.dtype).reshape(info.shape)


INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsCheckpoint:
    """A safetensors checkpoint: one file, or a directory of shards, addressed by tensor name.

    A directory is read from `model.safetensors.index.json` (its `weight_map` names the
    shard of every tensor) if present, else from `model.safetensors`, else from all its
    `*.safetensors` files (a name in two of them is an error). All shards are opened and
    validated up front.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.files: dict[str, SafetensorsFile] = {}  # shard file name -> open file
        self._where: dict[str, str] = {}  # tensor name -> shard file name
        if self.path.is_file():
            self._add(self.path)
            return
        if not self.path.is_dir():
            raise CheckpointError(f"{self.path}: no such safetensors file or checkpoint directory")
        index = self.path / INDEX_NAME
        if index.is_file():
            self._open_index(index)
        elif (self.path / SINGLE_NAME).is_file():
            self._add(self.path / SINGLE_NAME)
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"{self.path} holds no .safetensors files (nor {INDEX_NAME})")
            for shard in shards:
                self._add(shard)

    def _add(self, file: Path) -> None:
        st = SafetensorsFile(file)
        self.files[file.name] = st
        for name in st.keys():  # noqa: SIM118 - SafetensorsFile has keys() but is not iterable
            if name in self._where:
                raise CheckpointError(f"tensor {name!r} is in both {self.path / self._where[name]} and {file}; "
                                      f"remove the stray file or add a {INDEX_NAME}")
            self._where[name] = file.name

    def _open_index(self, index: Path) -> None:
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to shard file names")
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index} is not a valid safetensors index ({e!r}); the file is corrupt") from None
        for shard_name in sorted(set(weight_map.values())):
            shard = self.path / shard_name
            if not shard.is_file():
                raise CheckpointError(f"{index} names the shard {shard_name}, which is missing from {self.path}; "
                                      f"download it")
            self.files[shard_name] = SafetensorsFile(shard)
        for name, shard_name in weight_map.items():
            if name not in self.files[shard_name]:
                raise CheckpointError(f"{index} places tensor {name!r} in {self.path / shard_name}, which does "
                                      f"not hold it; the index and the shards do not match")
            self._where[name] = shard_name

    def keys(self) -> list[str]:
        """All tensor names."""
        return list(self._where)

    def __contains__(self, name: object) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def file_of(self, name: str) -> SafetensorsFile:
        """The open shard holding `name`."""
        try:
            return self.files[self._where[name]]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name!r}") from None

    def info(self, name: str) -> TensorInfo:
        """(dtype, shape, nbytes, offset in its shard) of one tensor."""
        return self.file_of(name).info(name)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a zero-copy view of its shard's map."""
        return self.file_of(name).tensor(name)

    def close(self) -> None:
        """Close every shard (see SafetensorsFile.close)."""
        for st in self.files.values():
            st.close()

    def __enter__(self) -> SafetensorsCheckpoint:  # noqa: PYI034 - typing.Self needs Python 3.11, the project supports 3.10
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"SafetensorsCheckpoint({str(self.path)!r}, {len(self.files)} files, {len(self._where)} tensors)"
