"""What `localmoe convert` reads: a checkpoint's tensors as byte ranges of its files.

`open_source(path)` turns an HF safetensors directory or a GGUF file (`open_checkpoint`) into a `Source`: the
family and ModelSpec, every tensor as a `TensorRef` (file, offset, dtype, shape), the
files to copy and an identity digest for the resume key. Nothing is read until
`SourceFiles.view(ref)` maps just that tensor's pages; the map goes away with the last
view of it, so the process holds only the tensors being written, never the model.
`ReadAhead` hints the kernel to fetch the next tensors (`POSIX_FADV_WILLNEED`, so reads
are large and asynchronous) and to drop the ones written (`POSIX_FADV_DONTNEED`).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import xxhash

from localmoe.checkpoint import Checkpoint, open_checkpoint
from localmoe.config import ModelSpec
from localmoe.errors import CheckpointError
from localmoe.models.base import ModelFamily

# copied from an HF directory when present: file name -> role in the store's manifest
HF_FILES = {"config.json": "config", "generation_config.json": "generation_config", "tokenizer.json": "tokenizer",
            "tokenizer_config.json": "tokenizer_config", "special_tokens_map.json": "special_tokens_map",
            "chat_template.jinja": "chat_template", "tokenizer.model": "tokenizer_model",
            "preprocessor_config.json": "preprocessor_config"}
GGUF_METADATA_FILE, GGUF_TENSORS_FILE = "gguf-metadata.json", "gguf-tensors.json"
# ggml types stored with their own dtype; every other (block-quantised) type is stored as raw U8 blocks
_GGML_PLAIN_TYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                     "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64}
READ_AHEAD = 128 << 20  # bytes of upcoming tensors the kernel is asked to fetch


@dataclass(frozen=True, slots=True)
class TensorRef:
    """One tensor's bytes: `nbytes` at absolute `offset` of `path`, row-major."""

    name: str
    path: Path
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def index0(self, i: int) -> TensorRef:
        """Entry `i` of dimension 0 (expert `i` of a stacked tensor): a contiguous sub-range."""
        if not self.shape or not 0 <= i < self.shape[0]:
            raise CheckpointError(f"{self.path}: tensor {self.name!r} of shape {list(self.shape)} has no entry {i} "
                                  f"in its first dimension")
        inner = self.shape[1:]
        return TensorRef(f"{self.name}[{i}]", self.path, self.offset + i * math.prod(inner) * self.dtype.itemsize,
                         self.dtype, inner)


@dataclass
class Source:
    """A checkpoint to convert. `tensors` is in file order (part after part for a split GGUF)."""

    path: Path
    kind: str  # "safetensors" | "gguf"
    family: ModelFamily
    spec: ModelSpec
    tensors: dict[str, TensorRef]
    weight_files: list[Path]
    files: list[tuple[Path, str, str]] = field(default_factory=list)  # (file, name in the store, role)
    generated: list[tuple[bytes, str, str]] = field(default_factory=list)  # (data, name in the store, role)
    config: dict = field(default_factory=dict)  # HF config.json ({} for GGUF)
    identity: str = ""  # digest of every input the output depends on
    ggml_types: dict = field(default_factory=dict)  # GGUF: tensor name -> GGMLQuantizationType

    def ref(self, name: str, what: str = "tensor") -> TensorRef:
        try:
            return self.tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path}: {what} {name!r} is missing from the checkpoint") from None


def open_source(path: str | os.PathLike) -> Source:
    """The checkpoint at `path` (`open_checkpoint`): an HF directory with config.json and safetensors, or a
    .gguf file. Only headers are read: the converter maps each tensor itself."""
    ckpt = open_checkpoint(path)
    try:
        if ckpt.kind == "gguf":
            source = _gguf_source(ckpt)
        elif ckpt.kind == "hf":
            source = _hf_source(ckpt)
        elif ckpt.kind == "store":
            raise CheckpointError(f"{ckpt.path} is a packed store already; convert an HF model directory or a "
                                  f".gguf file")
        else:
            raise CheckpointError(f"{ckpt.path} holds no .safetensors files, only the model config; convert an HF "
                                  f"model directory with its weights or a .gguf file")
    finally:
        ckpt.close()
    source.identity = _identity(source)
    return source


def _hf_source(ckpt: Checkpoint) -> Source:
    path, st = ckpt.path, ckpt.reader
    files = {name: f.path for name, f in st.files.items()}
    refs = []
    for name in ckpt.tensor_names + ckpt.nextn_tensor_names():  # MTP layers kept (dense) for --spec mtp
        info = st.info(name)
        refs.append(TensorRef(name, st.file_of(name).path, info.offset, info.dtype, info.shape))
    refs.sort(key=lambda r: (str(r.path), r.offset))
    extra = [(path / name, name, role) for name, role in HF_FILES.items() if (path / name).is_file()]
    return Source(path, "safetensors", ckpt.family, ckpt.spec, {r.name: r for r in refs}, sorted(files.values()),
                  extra, config=ckpt.config)


def _gguf_source(ckpt: Checkpoint) -> Source:
    path, gguf = ckpt.path, ckpt.reader
    refs, types, ggml_types = {}, {}, {}
    for name in ckpt.tensor_names:
        info = gguf.info(name)
        ggml_types[name] = info.ggml_type
        dtype = _GGML_PLAIN_TYPES.get(info.ggml_type.name)
        # float tensors keep their dtype; quantised ones are stored as their raw blocks,
        # shaped like GGUFFile.raw: [*outer dims, bytes per row]
        shape = info.shape if dtype is not None else tuple(gguf.raw(name).shape)
        refs[name] = TensorRef(name, gguf.file_of(name), info.offset, dtype or torch.uint8, shape)
        types[name] = {"ggml_type": info.ggml_type.name, "ggml_type_id": int(info.ggml_type),
                       "shape": list(info.shape)}
    tensors_json = {"format": "localmoe-gguf-tensors", "version": 1, "gguf_version": gguf.version, "tensors": types}
    generated = [(json.dumps(gguf.metadata, ensure_ascii=False, separators=(",", ":")).encode(),
                  GGUF_METADATA_FILE, "gguf_metadata"),
                 (json.dumps(tensors_json, indent=1).encode(), GGUF_TENSORS_FILE, "gguf_tensors")]
    template = gguf.metadata.get("tokenizer.chat_template")
    if isinstance(template, str):
        generated.append((template.encode(), "chat_template.jinja", "chat_template"))
    order = {p: i for i, p in enumerate(gguf.files)}  # a split model: part after part
    refs = dict(sorted(refs.items(), key=lambda kv: (order[kv[1].path], kv[1].offset)))
    return Source(path, "gguf", ckpt.family, ckpt.spec, refs, list(gguf.files), generated=generated,
                  ggml_types=ggml_types)


def _identity(source: Source) -> str:
    """Digest of what the output depends on: each weight file's name, size, mtime and header
    bytes (a rewritten or re-downloaded file changes its mtime) and each copied file's content."""
    parts: list = [source.kind]
    header_end = {p: min((r.offset for r in source.tensors.values() if r.path == p), default=0)
                  for p in source.weight_files}
    for p in source.weight_files:
        st = p.stat()
        with open(p, "rb") as f:
            header = xxhash.xxh3_64_hexdigest(f.read(min(header_end[p], 64 << 20)))
        parts.append([p.name, st.st_size, st.st_mtime_ns, header])
    for p, name, _ in source.files:
        parts.append([name, xxhash.xxh3_64_hexdigest(p.read_bytes())])
    return xxhash.xxh3_128_hexdigest(json.dumps(parts).encode())


class SourceFiles:
    """The open source files: maps one tensor at a time and passes read hints to the kernel."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._maps: dict[tuple[Path, int], mmap.mmap] = {}  # maps of tensors viewed and not yet released

    def _fd(self, path: Path) -> int:
        if path not in self._fds:
            try:
                self._fds[path] = os.open(path, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"cannot read {path}: {e.strerror or e}") from None
        return self._fds[path]

    def view(self, ref: TensorRef) -> torch.Tensor:
        """The tensor as a zero-copy view of a private map of just its pages (unmapped with the view)."""
        if ref.nbytes == 0:
            return torch.empty(ref.shape, dtype=ref.dtype)
        start = ref.offset - ref.offset % mmap.ALLOCATIONGRANULARITY
        try:
            m = mmap.mmap(self._fd(ref.path), ref.offset + ref.nbytes - start, access=mmap.ACCESS_COPY,
                          offset=start)
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{ref.path}: cannot map tensor {ref.name!r} ({e}); the file may be "
                                  f"truncated, download it again") from None
        self._maps[ref.path, ref.offset] = m
        # numpy holds a buffer export on the map, so it lives as long as the views
        t = torch.from_numpy(np.frombuffer(m, dtype=np.uint8, count=ref.nbytes, offset=ref.offset - start))
        if ref.offset % ref.dtype.itemsize:
            t = t.clone()  # an offset the dtype cannot view in place: copy this tensor
        return t.view(ref.dtype).reshape(ref.shape)

    def _advise(self, ref: TensorRef, advice: int) -> None:
        if ref.nbytes and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd(ref.path), ref.offset, ref.nbytes, advice)

    def will_need(self, ref: TensorRef) -> None:
        self._advise(ref, getattr(os, "POSIX_FADV_WILLNEED", 0))

    def dont_need(self, ref: TensorRef) -> None:
        """The tensor is written: unmap its pages from this process (a view still alive would
        fault them in again from the file) and drop them from the page cache."""
        m = self._maps.pop((ref.path, ref.offset), None)
        if m is not None and hasattr(mmap, "MADV_DONTNEED"):
            m.madvise(mmap.MADV_DONTNEED)
        self._advise(ref, getattr(os, "POSIX_FADV_DONTNEED", 0))

    def close(self) -> None:
        self._maps.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


class ReadAhead:
    """Views tensors in the order `refs` gives, keeping the next `window` bytes of them
    requested from the disk; `release` drops the pages of tensors whose views are gone."""

    def __init__(self, files: SourceFiles, refs: Iterable[TensorRef], window: int = READ_AHEAD) -> None:
        self.files, self.window = files, window
        self._upcoming: Iterator[TensorRef] = iter(refs)
        self._hinted: deque[TensorRef] = deque()
        self._hinted_keys: set[tuple[Path, int]] = set()
        self._hinted_bytes = 0

    def take(self, ref: TensorRef) -> torch.Tensor:
        """A view of `ref` (normally the next of `refs`; any other tensor is simply mapped)."""
        if (ref.path, ref.offset) in self._hinted_keys:
            while True:  # tensors hinted before `ref` but skipped are forgotten
                head = self._hinted.popleft()
                self._hinted_keys.discard((head.path, head.offset))
                self._hinted_bytes -= head.nbytes
                if head == ref:
                    break
        while self._hinted_bytes < self.window and (nxt := next(self._upcoming, None)) is not None:
            if nxt == ref:
                continue
            self.files.will_need(nxt)
            self._hinted.append(nxt)
            self._hinted_keys.add((nxt.path, nxt.offset))
            self._hinted_bytes += nxt.nbytes
        return self.files.view(ref)

    def release(self, refs: Iterable[TensorRef]) -> None:
        """Drop the pages of `refs` from the page cache; call once their views are gone."""
        for ref in refs:
            self.files.dont_need(ref)
