"""The packed store: a directory with manifest.json, dense safetensors shards and one
file of expert extents per MoE layer. `PackedStoreWriter` writes it streaming,
atomically and resumably; `PackedStore` opens it, checks it and hands out zero-copy
tensors, extents for the pager's own reads, and a full checksum pass (`verify`).
The on-disk format is specified in docs/store-format.md.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import xxhash

from localmoe.errors import CheckpointError
from localmoe.store.extents import (
    ExpertLayout,
)
from localmoe.store.fileio import CHUNK, drop_cache, read_into
from localmoe.store.manifest import (
    MANIFEST,
    PROGRESS,
    FileRecord,
    LayerRecord,
    Manifest,
)
from localmoe.store.safetensors import SafetensorsFile


class ExpertExtent(NamedTuple):
    """One expert on disk: read `nbytes` (a multiple of 4096) at `offset` (4096-aligned) of `path`.
    `checksum` is the xxh3_64 of exactly those bytes, as an int (`xxhash.xxh3_64_intdigest`)."""

    path: Path
    offset: int
    nbytes: int
    checksum: int


class StoreProblem(NamedTuple):
    """One thing `verify` found wrong; `str()` is the line to show."""

    file: str  # relative to the store
    message: str
    layer: int | None = None
    expert: int | None = None
    offset: int | None = None

    def __str__(self) -> str:
        return self.message


class PackedStore:
    """A packed store opened for reading. Opening checks the manifest and that every file
    it names exists and is long enough; checksums are checked by `verify` or on demand."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        manifest_path = self.path / MANIFEST
        if not manifest_path.is_file():
            if (self.path / PROGRESS).is_file():
                raise CheckpointError(f"{self.path}: the conversion into this packed store did not finish (it has "
                                      f"{PROGRESS} but no {MANIFEST}); run the same conversion again to resume it")
            if not self.path.is_dir():
                raise CheckpointError(f"{self.path}: no such packed store directory")
            raise CheckpointError(f"{self.path} is not a packed store: it has no {MANIFEST}")
        try:
            text = manifest_path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise CheckpointError(f"{manifest_path} is corrupt: not UTF-8 text; convert the model again") from None
        self.manifest = Manifest.parse(text, manifest_path)  # its model_spec: checkpoint.store_spec reads it
        for rec in [*self.manifest.files, *self.manifest.dense_shards]:
            self._check_size(rec.file, rec.nbytes, "")
        self._layers: dict[int, tuple[LayerRecord, ExpertLayout, dict[int, int]]] = {}
        for rec in self.manifest.layers:
            layout = self.manifest.layouts[rec.layout]
            self._check_size(rec.file, len(rec.experts) * layout.slot_bytes,
                             f" ({len(rec.experts)} experts of {layout.slot_bytes} bytes)")
            self._layers[rec.layer] = (rec, layout, {e: i for i, e in enumerate(rec.experts)})
        self._dense: dict[str, SafetensorsFile] = {}
        self._dense_file: dict[str, str] = {}
        for shard in self.manifest.dense_shards:
            st = self._dense[shard.file] = SafetensorsFile(self.path / shard.file)
            for name in shard.tensors:
                if name not in st:
                    raise CheckpointError(f"{self.path / shard.file} lacks dense tensor {name!r}, which "
                                          f"{MANIFEST} places there; convert the model again")
                self._dense_file[name] = shard.file

    def _check_size(self, file: str, needed: int, detail: str) -> None:
        path = self.path / file
        if not path.is_file():
            raise CheckpointError(f"{path} is missing from the packed store ({MANIFEST} lists it); "
                                  f"convert the model again or restore the file")
        size = path.stat().st_size
        if size < needed:
            raise CheckpointError(f"{path} is truncated: {MANIFEST} needs at least {needed} bytes{detail}, the "
                                  f"file has {size}; convert the model again or restore the file")

    # ---- dense tensors and files ----

    def dense_names(self) -> list[str]:
        return list(self._dense_file)

    def dense(self, name: str) -> torch.Tensor:
        """A dense tensor: a zero-copy view of its shard's map."""
        if name not in self._dense_file:
            raise CheckpointError(f"the packed store {self.path} has no dense tensor {name!r}")
        return self._dense[self._dense_file[name]].tensor(name)

    def file(self, role: str) -> Path | None:
        """The path of the extra file with `role` (e.g. "tokenizer"), or None."""
        return next((self.path / r.file for r in self.manifest.files if r.role == role), None)

    # ---- experts ----

    def layers(self) -> list[int]:
        """Layers that have routed experts, ascending."""
        return sorted(self._layers)

    def _layer(self, layer: int) -> tuple[LayerRecord, ExpertLayout, dict[int, int]]:
        try:
            return self._layers[layer]
        except KeyError:
            raise CheckpointError(f"the packed store {self.path} has no experts for layer {layer}") from None

    def layout(self, layer: int) -> ExpertLayout:
        return self._layer(layer)[1]

    def experts_in(self, layer: int) -> list[int]:
        """Expert ids stored for `layer`, ascending."""
        return sorted(self._layer(layer)[2])

    def expert_extent(self, layer: int, expert: int) -> ExpertExtent:
        """Where expert `expert` of `layer` lies, for the pager's own pread/O_DIRECT reads."""
        rec, layout, slot_of = self._layer(layer)
        if expert not in slot_of:
            raise CheckpointError(f"the packed store {self.path} has no expert {expert} in layer {layer}")
        i = slot_of[expert]
        return ExpertExtent(self.path / rec.file, i * layout.slot_bytes, layout.slot_bytes, int(rec.xxh3_64[i], 16))

    def expert(self, layer: int, expert: int, verify: bool = False) -> dict[str, torch.Tensor]:
        """One expert's tensors: zero-copy views of a copy-on-write map of its extent.

        With verify=True the extent's checksum is checked first (CheckpointError if wrong).
        """
        ext = self.expert_extent(layer, expert)
        start = ext.offset - ext.offset % mmap.ALLOCATIONGRANULARITY
        with open(ext.path, "rb") as f:
            m = mmap.mmap(f.fileno(), ext.offset + ext.nbytes - start, offset=start, access=mmap.ACCESS_COPY)
        # numpy holds a buffer export on the map: it is unmapped with the last tensor viewing it
        buf = np.frombuffer(m, dtype=np.uint8, count=ext.nbytes, offset=ext.offset - start)
        if verify and xxhash.xxh3_64_intdigest(buf) != ext.checksum:
            raise CheckpointError(f"{self._extent_name(layer, expert, ext)}: checksum mismatch; the store is "
                                  f"corrupt: run `localmoe verify {self.path}` and convert the model again")
        return self.layout(layer).views(buf)

    def _extent_name(self, layer: int, expert: int, ext: ExpertExtent) -> str:
        return f"layer {layer} expert {expert} in {self._layers[layer][0].file} at offset {ext.offset}"

    # ---- verification ----

    def total_bytes(self) -> int:
        """Bytes `verify` reads."""
        files = sum(r.nbytes for r in [*self.manifest.files, *self.manifest.dense_shards])
        return files + sum(len(rec.experts) * lay.slot_bytes for rec, lay, _ in self._layers.values())

    def verify(self, progress: Callable[[int], object] | None = None) -> list[StoreProblem]:
        """Check every checksum: extra files, dense shards, every expert extent.

        `progress(nbytes)` is called after each chunk read. Returns the problems found
        (empty when all is well), in file order.
        """
        progress = progress or (lambda n: None)
        problems: list[StoreProblem] = []
        for rec in [*self.manifest.files, *self.manifest.dense_shards]:
            problems += self._verify_file(rec, progress)
        for layer in self.layers():
            problems += self._verify_layer(layer, progress)
        return problems

    def _verify_file(self, rec: FileRecord, progress) -> list[StoreProblem]:
        h, done = xxhash.xxh3_64(), 0
        try:
            with open(self.path / rec.file, "rb", buffering=0) as f:
                while done < rec.nbytes and (chunk := f.read(min(CHUNK, rec.nbytes - done))):
                    h.update(chunk)
                    done += len(chunk)
                    progress(len(chunk))
                drop_cache(f.fileno())
        except OSError as e:
            return [StoreProblem(rec.file, f"{rec.file}: cannot be read at offset {done} ({e.strerror or e})")]
        if done < rec.nbytes:
            return [StoreProblem(rec.file, f"{rec.file}: truncated at {done} bytes of {rec.nbytes}")]
        if h.hexdigest() != rec.xxh3_64:
            return [StoreProblem(rec.file, f"{rec.file}: checksum mismatch")]
        return []

    def _verify_layer(self, layer: int, progress) -> list[StoreProblem]:
        rec, layout, _ = self._layers[layer]
        slot, n = layout.slot_bytes, len(rec.experts)
        per_read = max(1, CHUNK // slot)
        buf = memoryview(bytearray(per_read * slot))
        problems = []

        def problem(i: int, what: str) -> StoreProblem:
            return StoreProblem(rec.file, f"layer {layer} expert {rec.experts[i]} in {rec.file} at offset "
                                          f"{i * slot}: {what}", layer, rec.experts[i], i * slot)

        try:
            with open(self.path / rec.file, "rb", buffering=0) as f:
                for first in range(0, n, per_read):
                    count = min(per_read, n - first)
                    got = read_into(f, buf[:count * slot])
                    for j in range(count):
                        i = first + j
                        if (j + 1) * slot > got:
                            problems.append(problem(i, "missing (the file ends early)"))
                        elif xxhash.xxh3_64_hexdigest(buf[j * slot:(j + 1) * slot]) != rec.xxh3_64[i]:
                            problems.append(problem(i, "checksum mismatch"))
                    progress(count * slot)
                drop_cache(f.fileno())
        except OSError as e:
            problems.append(StoreProblem(rec.file, f"{rec.file}: cannot be read ({e.strerror or e})", layer))
        return problems

    def close(self) -> None:
        """Close the dense shards (see SafetensorsFile.close); expert views keep their own maps."""
        for st in self._dense.values():
            st.close()

    def __enter__(self) -> PackedStore:  # noqa: PYI034 - typing.Self needs Python 3.11, the project supports 3.10
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        n = sum(len(rec.experts) for rec, _, _ in self._layers.values())
        return f"PackedStore({str(self.path)!r}, {len(self._dense_file)} dense tensors, {n} experts)"

