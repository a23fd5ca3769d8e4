"""`PackedStoreWriter`: writes a packed store streaming, atomically and resumably.

Each data file is written as `<name>.partial`, fsync'd and renamed; a journal
(`.progress.json`) records finished files so a rerun skips them; `manifest.json` comes
last. The format is specified in docs/store-format.md.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np
import torch
import xxhash

from localmoe.config import ModelSpec
from localmoe.errors import CheckpointError
from localmoe.store.extents import (
    DTYPE_NAMES,
    ExpertLayout,
    checksum,
    dense_shard_header,
    nbytes_of,
    tensor_bytes,
)
from localmoe.store.fileio import CHUNK, finish_file
from localmoe.store.manifest import (
    MANIFEST,
    PARTIAL,
    PROGRESS,
    FileRecord,
    LayerRecord,
    Manifest,
    Progress,
    dense_file_name,
    fsync_dir,
    layer_file_name,
    write_atomic,
)

DENSE_SHARD_BYTES = 2 << 30  # a shard is closed before it would pass 2 GiB (one bigger tensor gets its own)
class _OpenLayer:
    """The layer file being written: extents appended in add order."""

    def __init__(self, dst: Path, layer: int, layout: ExpertLayout, layout_name: str) -> None:
        self.layer, self.layout, self.layout_name = layer, layout, layout_name
        self.file = layer_file_name(layer)
        self.partial = dst / (self.file + PARTIAL)
        self.partial.parent.mkdir(exist_ok=True)
        self.f = open(self.partial, "wb")  # noqa: SIM115 - open across add_expert calls; finish_file or abandon closes it
        self.slot = np.zeros(layout.slot_bytes, dtype=np.uint8)
        self.experts: list[int] = []
        self.sums: list[str] = []


class PackedStoreWriter:
    """Write a packed store into directory `dst`.

    Call `set_spec`, then add dense tensors, experts (each layer's together) and extra
    files in any interleaving, then `finish()`. Memory: one expert slot, plus the dense
    tensors of the shard being filled (none when added with `add_dense_lazy`).

    Atomic: data files are written as `<name>.partial`, fsync'd and renamed when
    complete; manifest.json is written last. Resumable: each completed file is recorded
    in `.progress.json`; a later writer with the same `resume_key` (a string naming the
    source and the conversion options) and `shard_bytes` keeps those files. Adding
    a dense tensor or an expert that a kept file already holds does nothing, so a
    converter may simply redo everything, or ask `layer_done(layer)` /
    `dense_done(name)` / `dense_shard_done(i)` and skip the work.
    """

    def __init__(self, dst: str | os.PathLike, *, resume_key: str = "", shard_bytes: int = DENSE_SHARD_BYTES,
                 overwrite: bool = False) -> None:
        self.dst = Path(dst)
        self.dst.mkdir(parents=True, exist_ok=True)
        if (self.dst / MANIFEST).exists():
            if not overwrite:
                raise CheckpointError(f"{self.dst} already holds a packed store; delete it or convert with --overwrite")
            (self.dst / MANIFEST).unlink()  # first, so no manifest ever points at half-rewritten files
            (self.dst / PROGRESS).unlink(missing_ok=True)
            fsync_dir(self.dst)
        for stale in [*self.dst.glob("*" + PARTIAL), *self.dst.glob("experts/*" + PARTIAL)]:
            stale.unlink()
        self._spec: ModelSpec | None = None
        self._pending: list[tuple[str, torch.dtype, tuple[int, ...], Callable[[], torch.Tensor]]] = []
        self._pending_bytes = 0
        self._open: _OpenLayer | None = None
        self._finished = False
        self._added_dense: set[str] = set()
        self._progress = self._resume(Progress.load(self.dst / PROGRESS), resume_key, shard_bytes)
        self._kept_layers = set(self._progress.layers)
        self._kept_dense = {name for s in self._progress.dense_shards for name in s.tensors}

    def _resume(self, old: Progress | None, resume_key: str, shard_bytes: int) -> Progress:
        new = Progress(resume_key, shard_bytes)
        if old is None or old.resume_key != resume_key or old.shard_bytes != shard_bytes:
            # drop a foreign journal now: once we replace a file it names, it would vouch for the wrong bytes
            if (self.dst / PROGRESS).exists():
                (self.dst / PROGRESS).unlink()
                fsync_dir(self.dst)
            return new
        new.layouts = old.layouts
        for i, shard in enumerate(old.dense_shards):  # shards are written in order: keep the intact prefix
            if shard.file != dense_file_name(i) or not self._intact(shard.file, shard.nbytes):
                break
            new.dense_shards.append(shard)
        for layer, rec in sorted(old.layers.items()):
            if self._intact(rec.file, len(rec.experts) * old.layouts[rec.layout].slot_bytes):
                new.layers[layer] = rec
        new.files = {name: rec for name, rec in old.files.items() if self._intact(rec.file, rec.nbytes)}
        return new

    def _intact(self, file: str, nbytes: int) -> bool:
        path = self.dst / file
        return path.is_file() and path.stat().st_size == nbytes

    def _save_progress(self) -> None:
        write_atomic(self.dst / PROGRESS, self._progress.to_json().encode())

    def _check_writable(self) -> None:
        if self._finished:
            raise ValueError(f"the packed store {self.dst} is finished; open a new writer to change it")

    # ---- what is done ----

    def layer_done(self, layer: int) -> bool:
        """Whether `layer`'s expert file is complete (this run or an earlier one)."""
        return layer in self._progress.layers

    def dense_done(self, name: str) -> bool:
        """Whether dense tensor `name` is in a completed shard."""
        return any(name in s.tensors for s in self._progress.dense_shards)

    def dense_shard_done(self, index: int) -> bool:
        """Whether dense shard `index` (0-based: dense-00001 is 0) is complete."""
        return index < len(self._progress.dense_shards)

    # ---- adding ----

    def set_spec(self, spec: ModelSpec) -> None:
        self._spec = spec

    def add_file(self, src: str | os.PathLike, name: str, role: str = "") -> None:
        """Copy file `src` into the store as `name` (a plain file name), e.g. tokenizer.json."""
        with open(src, "rb") as f:
            self._add_file(name, role, iter(lambda: f.read(CHUNK), b""))

    def add_file_bytes(self, data: bytes, name: str, role: str = "") -> None:
        """Store `data` as file `name`, e.g. a GGUF's tokenizer metadata dumped as JSON."""
        self._add_file(name, role, [data])

    def _add_file(self, name: str, role: str, chunks) -> None:
        self._check_writable()
        if "/" in name or name.startswith((".", "dense-")) or name in (MANIFEST, "experts"):
            raise ValueError(f"{name!r} cannot be an extra file's name in a packed store")
        partial, h, n = self.dst / (name + PARTIAL), xxhash.xxh3_64(), 0
        with open(partial, "wb") as f:  # finish_file closes it; the with closes it on an error
            for chunk in chunks:
                f.write(chunk)
                h.update(chunk)
                n += len(chunk)
            finish_file(f, partial)
        self._progress.files[name] = FileRecord(name, n, h.hexdigest(), role)
        self._save_progress()

    def add_dense(self, name: str, tensor: torch.Tensor) -> None:
        """Add a dense tensor; it is held until its shard is written."""
        self.add_dense_lazy(name, tensor.dtype, tuple(tensor.shape), lambda: tensor)

    def add_dense_lazy(self, name: str, dtype: torch.dtype, shape: tuple[int, ...],
                       load: Callable[[], torch.Tensor]) -> None:
        """Add a dense tensor by description; `load()` is called only when its bytes are written."""
        self._check_writable()
        if name in self._kept_dense:
            return
        if name in self._added_dense:
            raise ValueError(f"dense tensor {name!r} was added twice")
        if dtype not in DTYPE_NAMES:
            raise CheckpointError(f"dense tensor {name!r} has dtype {dtype}, which a packed store cannot hold")
        nbytes = nbytes_of(dtype, tuple(shape))
        if self._pending and self._pending_bytes + nbytes > self._progress.shard_bytes:
            self.flush_dense()
        self._added_dense.add(name)
        self._pending.append((name, dtype, tuple(shape), load))
        self._pending_bytes += nbytes

    def flush_dense(self) -> None:
        """Write the dense tensors added so far as one shard: header first, then each tensor's bytes."""
        if not self._pending:
            return
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        loads = {name: load for name, _, _, load in pending}
        header, placed = dense_shard_header([(name, dtype, shape) for name, dtype, shape, _ in pending])
        file = dense_file_name(len(self._progress.dense_shards))
        partial, h = self.dst / (file + PARTIAL), xxhash.xxh3_64(header)
        with open(partial, "wb") as f:  # finish_file closes it; the with closes it on an error
            f.write(header)
            for entry in placed:
                t = loads.pop(entry.name)()
                if t.dtype != entry.dtype or tuple(t.shape) != entry.shape:
                    raise CheckpointError(f"dense tensor {entry.name!r} loaded as {t.dtype} {list(t.shape)}, not "
                                          f"the announced {entry.dtype} {list(entry.shape)}")
                data = tensor_bytes(t)
                for begin in range(0, entry.nbytes, CHUNK):
                    chunk = data[begin:begin + CHUNK]
                    f.write(chunk)
                    h.update(chunk)
                del t, data
            nbytes = f.tell()
            finish_file(f, partial)
        self._progress.dense_shards.append(FileRecord(file, nbytes, h.hexdigest(), tensors=[e.name for e in placed]))
        self._save_progress()

    def add_expert(self, layer: int, expert: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Append one expert (all its matrices, scales and biases) to `layer`'s file as one extent.

        A layer's experts must be added together: adding to another layer completes this one.
        Every expert of a layer must have the first one's tensor names, dtypes and shapes.
        """
        self._check_writable()
        if layer in self._kept_layers:
            return
        if self._open is None or self._open.layer != layer:
            self.finish_layer()
            if layer in self._progress.layers:
                raise ValueError(f"layer {layer}'s experts were already written; add each layer's experts together")
            try:
                layout = ExpertLayout.for_tensors(tensors)
            except ValueError as e:
                raise CheckpointError(f"layer {layer} expert {expert}: {e}") from None
            self._open = _OpenLayer(self.dst, layer, layout, self._layout_name(layout))
        ol = self._open
        if expert in ol.experts:
            raise ValueError(f"layer {layer} expert {expert} was added twice")
        try:
            ol.layout.check(tensors)
        except ValueError as e:
            raise CheckpointError(f"layer {layer} expert {expert} {e}") from None
        ol.layout.pack(tensors, ol.slot)
        ol.f.write(memoryview(ol.slot))
        ol.experts.append(expert)
        ol.sums.append(checksum(ol.slot))

    def _layout_name(self, layout: ExpertLayout) -> str:
        for name, known in self._progress.layouts.items():
            if known == layout:
                return name
        name = f"layout-{len(self._progress.layouts)}"
        self._progress.layouts[name] = layout
        return name

    def finish_layer(self) -> None:
        """Complete the layer file being written (also done by adding another layer, or by finish)."""
        ol, self._open = self._open, None
        if ol is None:
            return
        finish_file(ol.f, ol.partial)
        self._progress.layers[ol.layer] = LayerRecord(ol.layer, ol.file, ol.layout_name, ol.experts, ol.sums)
        self._save_progress()

    # ---- finishing ----

    def finish(self) -> Path:
        """Write what is pending, then manifest.json; returns the store's path."""
        self._check_writable()
        if self._spec is None:
            raise ValueError("call set_spec() before finish()")
        self.flush_dense()
        self.finish_layer()
        p = self._progress
        layers = [p.layers[layer] for layer in sorted(p.layers)]
        # a checkpoint's next-n (MTP) layers follow the model's (`ModelSpec.nextn_layers`): their experts too
        limit = self._spec.num_layers + self._spec.nextn_layers
        beyond = [r.layer for r in layers if r.layer >= limit]
        if beyond:
            raise ValueError(f"experts of layers {beyond} are past the model's {self._spec.num_layers} layers "
                             f"and {self._spec.nextn_layers} MTP layer(s)")
        used = {r.layout for r in layers}
        manifest = Manifest(self._spec.to_dict(), [p.files[n] for n in sorted(p.files)], p.dense_shards,
                            {n: lay for n, lay in p.layouts.items() if n in used}, layers)
        write_atomic(self.dst / MANIFEST, manifest.to_json().encode())
        (self.dst / PROGRESS).unlink(missing_ok=True)
        keep = {r.file for r in layers} | {s.file for s in p.dense_shards}
        for old in [*self.dst.glob("dense-*.safetensors"), *self.dst.glob("experts/layer-*.bin")]:
            if old.relative_to(self.dst).as_posix() not in keep:
                old.unlink()  # left by an earlier conversion into the same directory
        fsync_dir(self.dst)
        self._finished = True
        return self.dst

    def abandon(self) -> None:
        """Stop without a manifest; completed files stay for a later writer to resume."""
        if self._open is not None:
            self._open.f.close()
            self._open = None
        self._finished = True

    def __enter__(self) -> PackedStoreWriter:  # noqa: PYI034 - typing.Self needs Python 3.11, the project supports 3.10
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None and not self._finished:
            self.finish()
        elif exc_type is not None:
            self.abandon()

