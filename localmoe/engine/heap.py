"""Free heap returned to the system between the sublayers of a long-context prefill chunk (glibc).

A prefill chunk's large temporaries (1-8 MiB: attention key blocks, KDA's chunked form, MLP intermediates)
come from glibc's heap once its dynamic mmap threshold has risen past them, and the heap keeps what they
leave free: at 128k tokens of K3 `small` that free heap was ~45 of the ~85 MiB the chunk added over its
cache (docs/performance.md "Prefill working memory"). Where the cache is long, its bytes are what the
working memory is judged against, so there the free heap is handed back (`malloc_trim`) before a sublayer
when more than `FREE_MAX` of it is free. Short contexts keep glibc's behaviour (no trims: each costs page
faults when the heap grows again). Elsewhere than glibc, nothing is done.
"""

from __future__ import annotations

import ctypes
import ctypes.util

LONG_CONTEXT = 32768  # cache positions from which prefill chunks trim
FREE_MAX = 8 << 20  # bytes of free heap left in place


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_libc: ctypes.CDLL | None | bool = None


def _glibc():
    global _libc
    if _libc is None:
        _libc = False
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            lib.mallinfo2.restype, lib.malloc_trim.argtypes = _MallInfo2, [ctypes.c_size_t]
            _libc = lib
        except (OSError, AttributeError):  # not glibc (or older than 2.33: no mallinfo2)
            pass
    return _libc or None


def free_heap() -> int:
    """Bytes glibc's main heap holds free (0 where it cannot be asked)."""
    lib = _glibc()
    return 0 if lib is None else lib.mallinfo2().fordblks


def long_chunk(start: int, T: int) -> bool:
    """Whether a T-token chunk from cache position `start` is a long-context prefill chunk (module doc)."""
    return T > 1 and start + T >= LONG_CONTEXT


def release() -> None:
    """Return glibc's free heap to the system where more than FREE_MAX bytes of it are free (module doc)."""
    lib = _glibc()
    if lib is not None and lib.mallinfo2().fordblks > FREE_MAX:
        lib.malloc_trim(0)
