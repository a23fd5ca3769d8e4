"""engine/heap.py: free heap handed back between the sublayers of long-context prefill chunks (glibc)."""

from __future__ import annotations

import ctypes

import pytest

from localmoe.engine import heap


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))


def test_long_chunk():
    assert heap.long_chunk(heap.LONG_CONTEXT - 512, 512)
    assert not heap.long_chunk(heap.LONG_CONTEXT - 513, 512)
    assert not heap.long_chunk(heap.LONG_CONTEXT + 10, 1)  # decode steps never trim


@pytest.mark.skipif(heap._glibc() is None, reason="needs glibc's mallinfo2 / malloc_trim")
def test_release_returns_free_heap():
    """Blocks freed below a live one stay in the heap (and in RSS) until `release`; it returns them only when
    more than FREE_MAX is free."""
    lib = heap._glibc()
    lib.malloc.restype, lib.malloc.argtypes, lib.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
    size, count = 60 << 10, (3 * heap.FREE_MAX) // (60 << 10)  # under the mmap threshold: from the heap
    blocks = [lib.malloc(size) for _ in range(count)]
    keep = lib.malloc(size)  # above them: the freed space is not the heap's top, so free() keeps it
    for b in blocks:
        ctypes.memset(b, 1, size)
    for b in blocks:
        lib.free(b)
    assert heap.free_heap() > heap.FREE_MAX
    before = _rss()
    heap.release()
    assert before - _rss() > heap.FREE_MAX  # most of the 3 x FREE_MAX freed bytes left RSS
    lib.free(keep)
