"""Disk tier: read one expert extent from the packed store into a RAM slot.

Two backends, same contract (`read(layer, expert, out) -> bytes read`):
- `ODirectBackend`: `preadv` with O_DIRECT into the (page-aligned) slot: the page cache
  is bypassed, so the RAM budget is the only RAM the experts use.
- `MmapBackend`: copy out of a read-only map of the layer file, asking the kernel for the
  range ahead (MADV_WILLNEED), then dropping it from the mapping (MADV_DONTNEED) and the
  page cache (POSIX_FADV_DONTNEED), so the page cache does not keep a second copy.

Both check what they read against the extent's xxh3_64 (CorruptExpertError names layer,
expert, file and offset) and that the file is still the one opened: a deleted or
replaced store file raises StoreChangedError instead of serving other bytes. The pager's
native readers (paging/readers.py) do `ODirectBackend`'s reads and checks in C++ and report
them with the same codes, which `failure` turns into the same errors.
"""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import xxhash

from localmoe.config import PAGING_IO
from localmoe.paging.errors import CorruptExpertError, PagingError, StoreChangedError

BACKENDS = PAGING_IO  # the names, declared with PagingConfig
# How a read ended (the native readers' codes too: kernels/paged_io/reader_cpu.cpp)
OK, SHORT, CHECKSUM, ERRNO, DELETED, REPLACED, MODIFIED = range(7)


@dataclass
class _OpenFile:
    path: Path
    fd: int
    ident: tuple[int, int, int, int]  # st_dev, st_ino, st_size, st_mtime_ns at open
    map: mmap.mmap | None = None


def _ident(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class DiskBackend:
    """Reads extents of `store` (a PackedStore); subclasses do the actual read."""

    name = "base"
    flags = os.O_RDONLY

    def __init__(self, store, verify: bool = True):
        self.store, self.verify = store, verify
        self._files: dict[Path, _OpenFile] = {}
        self._lock = threading.Lock()

    def file(self, path: Path) -> _OpenFile:
        """The open file at `path` (opened once, kept: its descriptor and its identity at open)."""
        with self._lock:
            f = self._files.get(path)
            if f is None:
                try:
                    fd = os.open(path, self.flags | getattr(os, "O_CLOEXEC", 0))
                except FileNotFoundError:
                    raise StoreChangedError(f"{path} was deleted while the model was running; restore it or "
                                            f"load the model again") from None
                except OSError as e:
                    raise PagingError(f"{path}: cannot be opened for {self.name} reads ({e.strerror}); "
                                      f"try --io mmap") from None
                f = self._files[path] = _OpenFile(path, fd, _ident(os.fstat(fd)))
                self._opened(f)
            return f

    def _opened(self, f: _OpenFile) -> None:
        pass

    def changed(self, f: _OpenFile) -> int:
        """DELETED, REPLACED or MODIFIED where the path no longer names the file opened, else OK."""
        try:
            now = _ident(os.stat(f.path))
        except FileNotFoundError:
            return DELETED
        if now != f.ident:
            return REPLACED if now[:2] != f.ident[:2] else MODIFIED
        return OK

    def failure(self, layer: int, expert: int, code: int, detail: int = 0, reason: str | None = None) -> Exception:
        """The error for a read of expert `expert` of `layer` that ended with `code` (SHORT: `detail` bytes read;
        ERRNO: `detail` is the errno, `reason` its text if known), naming the file and the extent."""
        ext = self.store.expert_extent(layer, expert)
        if code == DELETED:
            return StoreChangedError(f"{ext.path} was deleted while the model was running; restore it or load the "
                                     f"model again")
        if code in (REPLACED, MODIFIED):
            what = "replaced by another file" if code == REPLACED else "modified"
            return StoreChangedError(f"{ext.path} was {what} while the model was running; load the model again "
                                     f"(the pager will not mix experts of two stores)")
        if code == ERRNO:
            return PagingError(f"layer {layer} expert {expert}: reading {ext.path} at offset {ext.offset} failed "
                               f"({reason or os.strerror(detail)})")
        if code == SHORT:
            return StoreChangedError(f"layer {layer} expert {expert}: {ext.path} ends at {ext.offset + detail}, "
                                     f"before the extent's end {ext.offset + ext.nbytes}: the file was truncated")
        if code == CHECKSUM:
            return CorruptExpertError(f"layer {layer} expert {expert} in {ext.path} at offset {ext.offset}: checksum "
                                      f"mismatch; the store is corrupt: run `localmoe verify {self.store.path}` and "
                                      f"convert the model again")
        raise ValueError(f"unknown read result code {code}")

    def read(self, layer: int, expert: int, out: np.ndarray) -> int:
        """Read expert `expert` of `layer` into `out` (uint8, >= the extent, page-aligned); returns bytes read."""
        ext = self.store.expert_extent(layer, expert)
        f = self.file(ext.path)
        code = self.changed(f)
        if code != OK:
            raise self.failure(layer, expert, code)
        view = out[:ext.nbytes]
        try:
            got = self._read(f, ext.offset, view)
        except OSError as e:
            raise self.failure(layer, expert, ERRNO, e.errno or 0, e.strerror or str(e)) from None
        if got < ext.nbytes:
            raise self.failure(layer, expert, SHORT, got)
        if self.verify and xxhash.xxh3_64_intdigest(view) != ext.checksum:
            raise self.failure(layer, expert, CHECKSUM)
        return ext.nbytes

    def native(self) -> bool:
        """Whether the native readers (kernels/paged_io) may do this backend's reads: its own O_DIRECT read, checks
        and errors, not a subclass's."""
        return False

    def _read(self, f: _OpenFile, offset: int, view: np.ndarray) -> int:
        raise NotImplementedError

    def close(self) -> None:
        with self._lock:
            for f in self._files.values():
                if f.map is not None:
                    f.map.close()
                os.close(f.fd)
            self._files.clear()


class ODirectBackend(DiskBackend):
    name = "odirect"
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)

    def native(self) -> bool:
        cls = type(self)
        return (cls._read is ODirectBackend._read and cls.read is DiskBackend.read and cls.changed is DiskBackend.changed
                and cls.failure is DiskBackend.failure)

    def _read(self, f: _OpenFile, offset: int, view: np.ndarray) -> int:
        got, mv = 0, memoryview(view)
        while got < len(mv):
            n = os.preadv(f.fd, [mv[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got


class MmapBackend(DiskBackend):
    name = "mmap"

    def _opened(self, f: _OpenFile) -> None:
        f.map = mmap.mmap(f.fd, 0, access=mmap.ACCESS_READ)

    def _read(self, f: _OpenFile, offset: int, view: np.ndarray) -> int:
        n = min(len(view), max(0, len(f.map) - offset))
        f.map.madvise(mmap.MADV_WILLNEED, offset, n)
        view[:n] = np.frombuffer(f.map, dtype=np.uint8, count=n, offset=offset)
        f.map.madvise(mmap.MADV_DONTNEED, offset, n)  # out of our mapping ...
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(f.fd, offset, n, os.POSIX_FADV_DONTNEED)  # ... and out of the page cache
        return n


def make_backend(name: str, store, verify: bool = True) -> DiskBackend:
    if name == "odirect":
        if not hasattr(os, "O_DIRECT"):
            raise PagingError("O_DIRECT reads are not available on this system; use --io mmap")
        return ODirectBackend(store, verify)
    if name == "mmap":
        return MmapBackend(store, verify)
    raise PagingError(f"unknown paging I/O backend {name!r}; choose one of {', '.join(BACKENDS)}")
