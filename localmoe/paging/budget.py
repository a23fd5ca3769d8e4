"""Checking that a RAM budget is honoured, page cache included.

- `MemoryCgroup`: a cgroup v1 memory group (root only): its usage counts the process's
  anonymous memory AND the page cache it causes, and `failcnt` counts the times usage hit
  the limit (the kernel then reclaims): a process that stays within budget on its own
  never makes it move.
- Without a writable cgroup: `rss_bytes()` plus the store files' pages resident in the
  page cache, measured with mincore(2) (`cached_bytes`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
from pathlib import Path

CGROUP_MEMORY = Path("/sys/fs/cgroup/memory")


def cgroup_writable() -> bool:
    return os.geteuid() == 0 and os.access(CGROUP_MEMORY, os.W_OK) and (CGROUP_MEMORY / "cgroup.procs").exists()


class MemoryCgroup:
    """A child memory cgroup; `add(pid)` moves a process in, `remove()` moves it back out and deletes it."""

    def __init__(self, name: str):
        self.path = CGROUP_MEMORY / name
        self.path.mkdir(exist_ok=True)

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text())

    def _write(self, name: str, value) -> None:
        (self.path / name).write_text(str(value))

    def set_limit(self, nbytes: int) -> None:
        self._write("memory.limit_in_bytes", nbytes)

    def add(self, pid: int | None = None) -> None:
        self._write("cgroup.procs", pid or os.getpid())

    def usage(self) -> int:
        return self._read("memory.usage_in_bytes")

    def max_usage(self) -> int:
        return self._read("memory.max_usage_in_bytes")

    def failcnt(self) -> int:
        return self._read("memory.failcnt")

    def reset_peak(self) -> None:
        self._write("memory.max_usage_in_bytes", 0)
        self._write("memory.failcnt", 0)

    def cache_bytes(self) -> int:
        for line in (self.path / "memory.stat").read_text().splitlines():
            if line.startswith("cache "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        parent = self.path.parent / "cgroup.procs"
        for pid in (self.path / "cgroup.procs").read_text().split():
            try:
                parent.write_text(pid)
            except OSError:
                pass
        try:
            self.path.rmdir()
        except OSError:
            pass


def rss_bytes(pid: str | int = "self") -> int:
    """Resident set size of a process (anonymous + mapped file pages it has touched)."""
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * mmap.PAGESIZE


_libc = None


def _lib():
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        _libc.mmap.restype = ctypes.c_void_p
        _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                               ctypes.c_long]
        _libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    return _libc


def cached_bytes(path: str | os.PathLike) -> int:
    """Bytes of `path` resident in the page cache now (mincore over a fresh map)."""
    size = os.path.getsize(path)
    if size == 0:
        return 0
    libc = _lib()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            return sum(b & 1 for b in vec.raw) * mmap.PAGESIZE
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)


def store_cached_bytes(store) -> int:
    """Page-cache bytes of every expert file of a PackedStore."""
    files = {store.expert_extent(layer, store.experts_in(layer)[0]).path for layer in store.layers()}
    return sum(cached_bytes(f) for f in files)


def drop_store_cache(store) -> None:
    """Drop the expert files of a PackedStore from the page cache (clean pages only)."""
    for layer in store.layers():
        fd = os.open(store.expert_extent(layer, store.experts_in(layer)[0]).path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
