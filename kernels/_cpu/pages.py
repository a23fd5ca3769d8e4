"""Weights the CPU kernels stream, placed on 2 MiB (transparent huge) pages.

A decode token reads every dense weight once from RAM. On 4 KiB pages that stream takes a TLB miss
every 4 KiB and the hardware prefetchers stop at every page boundary: the dense GEMV read 17.6 GB/s
from 4 KiB pages against 27.4 GB/s from 2 MiB ones (one thread, 200 MB of fp32 rows, alternated in
one process, Zen 4; docs/performance.md "Kimi K3 decode on huge pages"). Linux backs private
anonymous memory with huge pages under `madvise(MADV_HUGEPAGE)` (transparent_hugepage `madvise`
mode, the usual default) when the advice comes before the first touch, so `huge_copy` copies a
tensor into chunks mapped and advised that way. Small tensors share a chunk (most of a small
model's matrices are under 2 MiB), so a layer's whole stack of matrices lies on huge pages.

Where the system has no transparent huge pages (or says `never`), the chunks are ordinary memory:
the same values, only the speed differs. A chunk lives as long as any tensor in it, so only
weights kept for the model's lifetime belong here (not temporaries).
"""

from __future__ import annotations

import bisect
import mmap
import threading
import weakref

import numpy as np
import torch

HUGE = 2 << 20  # bytes of a transparent huge page (x86-64)
CHUNK = 64 << 20  # bytes of a shared chunk; tensors over a quarter of it get a chunk of their own
MIN_BYTES = 64 << 10  # smaller tensors (norms, biases, tiny matrices) stay where they are
ALIGN = 64  # bytes: every tensor starts on a cache line

_lock = threading.Lock()
_open: list = [None, 0]  # the shared chunk being filled (a uint8 tensor) and its next free byte
_chunks: list[tuple[int, int, weakref.ref]] = []  # (start, end, the map's array: alive while any view is), by start


def _new_chunk(nbytes: int) -> torch.Tensor:
    """A uint8 tensor of `nbytes` (a multiple of HUGE) starting on a HUGE boundary, advised for huge pages
    before anything touches it."""
    raw = mmap.mmap(-1, nbytes + HUGE, flags=mmap.MAP_PRIVATE)  # shared maps are shmem: no THP there
    view = np.frombuffer(raw, dtype=np.uint8)  # holds an export: the map stays while a tensor views it
    start = (-view.ctypes.data) % HUGE
    try:
        raw.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
    except OSError:
        pass  # transparent huge pages disabled: ordinary pages, the same values
    chunk = torch.from_numpy(view[start:start + nbytes])
    _chunks[:] = [c for c in _chunks if c[2]() is not None]
    bisect.insort(_chunks, (chunk.data_ptr(), chunk.data_ptr() + nbytes, weakref.ref(view)))
    return chunk


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether the tensor lies in a chunk of `huge_copy`."""
    ptr = tensor.data_ptr()
    with _lock:
        i = bisect.bisect_right(_chunks, (ptr, float("inf"))) - 1
        return i >= 0 and _chunks[i][0] <= ptr < _chunks[i][1] and _chunks[i][2]() is not None


def huge_copy(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's values, contiguous, on huge pages: a copy, or the tensor itself where it already is
    there, is small (MIN_BYTES), is not on the CPU, or where this system has no `MADV_HUGEPAGE`."""
    nbytes = tensor.numel() * tensor.element_size()
    if (tensor.device.type != "cpu" or nbytes < MIN_BYTES or not hasattr(mmap, "MADV_HUGEPAGE")
            or (tensor.is_contiguous() and on_huge_pages(tensor))):
        return tensor
    with _lock:
        if nbytes > CHUNK // 4:  # a large tensor: a chunk of its own, no shared tail left behind
            memory = _new_chunk(-(-nbytes // HUGE) * HUGE)[:nbytes]
        else:
            if _open[0] is None or _open[1] + nbytes > CHUNK:
                _open[0], _open[1] = _new_chunk(CHUNK), 0
            memory = _open[0][_open[1]:_open[1] + nbytes]
            _open[1] += -(-nbytes // ALIGN) * ALIGN
    out = memory.view(tensor.dtype).view(tensor.shape)
    out.copy_(tensor)
    return out
