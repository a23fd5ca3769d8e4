"""A streaming safetensors writer: the header first, then each tensor's bytes in turn.

The header is computed from the `(name, dtype, shape)` list alone, so a file of any size
is written with one chunk of one tensor in memory at a time. The result is atomic: bytes
go to a temporary file in the target directory, which is fsynced and renamed over `path`.

File layout (https://github.com/huggingface/safetensors): `u64 little-endian N | N bytes
of JSON header | data`. The header maps each name to `{"dtype", "shape",
"data_offsets": [begin, end]}` relative to the start of the data, with no holes, plus an
optional `"__metadata__": {str: str}`. Like the reference writer we pad the header with
spaces to a multiple of 8 bytes; put wider dtypes first (see `alignment_order`) so each
tensor starts on a multiple of its element size.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from localmoe.errors import CheckpointError

DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1,
}

Buffer = bytes | bytearray | memoryview | np.ndarray
_E = TypeVar("_E")


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One tensor as the header describes it."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_SIZES[self.dtype]


def alignment_order(entries: Iterable[_E]) -> list[_E]:
    """`entries` (anything with a `dtype`) stably sorted by element size, widest first, so
    every tensor's offset is a multiple of its element size."""
    return sorted(entries, key=lambda e: -DTYPE_SIZES[e.dtype])


def header_bytes(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None, align: int = 8) -> bytes:
    """The preamble and JSON header for `entries` laid out in the given order.

    The JSON is padded with spaces so the data starts at a multiple of `align` (8 like
    the reference writer; the packed store uses 4096 so tensors can be read O_DIRECT).
    """
    header: dict[str, object] = {}
    if metadata:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise CheckpointError("safetensors __metadata__ must map str to str")
        header["__metadata__"] = dict(metadata)
    offset = 0
    for e in entries:
        if e.dtype not in DTYPE_SIZES:
            raise CheckpointError(f"tensor {e.name!r}: unknown safetensors dtype {e.dtype!r}")
        if e.name in header or e.name == "__metadata__":
            raise CheckpointError(f"tensor {e.name!r} appears twice")
        if any(not isinstance(d, int) or d < 0 for d in e.shape):
            raise CheckpointError(f"tensor {e.name!r}: bad shape {e.shape}")
        header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % align)
    return struct.pack("<Q", len(text)) + text


def file_size(entries: Sequence[TensorEntry], metadata: dict[str, str] | None = None) -> int:
    """The exact size in bytes of the file `write_safetensors` makes from `entries`."""
    return len(header_bytes(entries, metadata)) + sum(e.nbytes for e in entries)


def write_safetensors(
    path: str | os.PathLike,
    entries: Sequence[TensorEntry],
    chunks: Callable[[TensorEntry], Iterable[Buffer]],
    metadata: dict[str, str] | None = None,
    on_bytes: Callable[[int], None] | None = None,
) -> Path:
    """Write `entries`, in order, to `path`; `chunks(entry)` yields that tensor's raw bytes.

    Each tensor's chunks must add up to exactly `entry.nbytes` (little-endian element
    bytes, C order). `on_bytes(n)` is called after each chunk, for progress bars. Nothing
    is left at `path` unless the whole file was written and synced.
    """
    path = Path(path)
    head = header_bytes(entries, metadata)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            for e in entries:
                written = 0
                for chunk in chunks(e):
                    view = memoryview(chunk).cast("B")
                    written += f.write(view)
                    if on_bytes is not None:
                        on_bytes(len(view))
                if written != e.nbytes:
                    raise CheckpointError(f"tensor {e.name!r}: got {written} bytes of data, expected {e.nbytes}")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # not every platform can open a directory
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
