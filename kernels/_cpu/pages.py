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
from collections import deque

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


# Buffers that come and go (a sequence's K/V pools, made per request and grown by doubling): `huge_empty`. One
# decode step of 16 sequences reads ~48 MB of them (embedded model, context 65), each sequence's per-layer pools
# 56-200 KiB: on 4 KiB pages the 16-row step's attention paid ~1.3 ms more (docs/performance.md, "The 16-row step,
# session 13"). A piece smaller than a huge page comes from a slab of 2 MiB holding pieces of its size only (a
# pool of 192 KiB: ten to a slab, 6% left at the slab's end; pieces are not rounded to 2 MiB each), and goes back
# to its size's free list once no tensor uses it, for the next pool of that size: slabs are kept, so the memory
# held is the most the pools of each size ever held at once. A larger piece is a map of its own, rounded up to
# 2 MiB and unmapped with its last tensor.
_free: dict[int, list[tuple[np.ndarray, int]]] = {}  # piece bytes -> (its slab, offset) of the free pieces
_returned: deque = deque()  # pieces freed (by the garbage collector, any thread): moved to `_free` under the lock
slab_bytes = 0  # bytes of the slabs made so far (kept for reuse)


def huge_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on huge pages (transparent huge pages where the system has them),
    for buffers that are made and dropped while the process runs; its memory is reused once no tensor uses it."""
    nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    if nbytes == 0 or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    size = -(-nbytes // ALIGN) * ALIGN
    if size > HUGE // 2:  # one or two to a slab would waste as much as rounding up: a map of its own
        return _new_chunk(-(-size // HUGE) * HUGE)[:nbytes].view(dtype).view(shape)
    with _lock:
        while _returned:
            piece_size, slab, offset = _returned.popleft()
            _free.setdefault(piece_size, []).append((slab, offset))
        free = _free.setdefault(size, [])
        if not free:
            slab = _new_chunk(HUGE).numpy()  # (the chunk's tensor is dropped; the array holds the map)
            global slab_bytes
            slab_bytes += HUGE
            free.extend((slab, offset) for offset in reversed(range(0, HUGE - size + 1, size)))
        slab, offset = free.pop()
    piece = slab[offset:offset + size]  # a view of its own: the piece is free again when no tensor holds it
    weakref.finalize(piece, _returned.append, (size, slab, offset))
    return torch.from_numpy(piece)[:nbytes].view(dtype).view(shape)
