"""The pager's native reader pool (reader_cpu.cpp, part of the localmoe CPU library): C++ threads that read
extents with O_DIRECT preadv into RAM slots and check their xxh3_64 without the interpreter lock.

`ReaderPool(threads)`: `submit` a read (demanded ones before guesses), `cancel` one no reader took yet, `wait`
for one (the interpreter lock is dropped while waiting), `reap` the finished ones as (id, code, detail). The codes
are localmoe.paging.disk's (OK, SHORT, CHECKSUM, ERRNO, DELETED, REPLACED, MODIFIED). `available()`: whether the
library (and so the pool) runs here. xxhash.h is xxHash 0.8.3 by Yann Collet, BSD 2-Clause (XXHASH_LICENSE).
"""

from __future__ import annotations

import numpy as np
from localmoe.kernels._cpu import library

REAP = 256  # finished reads collected per library call


def available() -> bool:
    return library() is not None


class ReaderPool:
    """Up to `threads` C++ reader threads (started as reads are submitted; `close` ends them). Submit, cancel and
    close from one thread at a time (the pager does, under its lock)."""

    def __init__(self, threads: int):
        self._lib = library()
        self._pool = self._lib.pio_open(threads)  # never freed (a few bytes): a wait racing with `close` is safe
        self._closed = False
        self._out = np.empty(3 * REAP, np.int64)
        self._out_ptr = self._out.ctypes.data

    def file(self, fd: int, path: str, dev: int, ino: int, size: int, mtime_ns: int) -> int:
        """Registers an open file and the identity it had at open (each read first checks the path still names
        it); returns its index for `submit`."""
        return self._lib.pio_file(self._pool, fd, path.encode(), dev, ino, size, mtime_ns)

    def submit(self, read_id: int, file: int, offset: int, nbytes: int, address: int, checksum: int, verify: bool,
               urgent: bool) -> None:
        """Read `nbytes` at `offset` of `file` into memory at `address` (page-aligned), checking the checksum when
        `verify`; `urgent` reads go before the others, each kind in submission order."""
        self._lib.pio_submit(self._pool, read_id, file, offset, nbytes, address, checksum, int(verify), int(urgent))

    def cancel(self, read_id: int) -> bool:
        """Drops the read if no reader took it yet (then it is never read nor reaped); whether it did."""
        return bool(self._lib.pio_cancel(self._pool, read_id))

    def wait(self, read_id: int, timeout: float) -> bool:
        """Waits up to `timeout` s until the read is finished (or was never submitted); False on timeout."""
        return bool(self._lib.pio_wait(self._pool, read_id, timeout))

    def wait_any(self, timeout: float) -> bool:
        """Waits up to `timeout` s until some read is finished and not yet reaped; False on timeout."""
        return bool(self._lib.pio_wait_any(self._pool, timeout))

    def reap(self) -> list[tuple[int, int, int]]:
        """The reads finished since the last call, oldest first: (id, code, detail)."""
        out = []
        while True:
            n = self._lib.pio_reap(self._pool, self._out_ptr, REAP)
            if n == 0:
                return out
            out += [tuple(row) for row in self._out[:3 * n].reshape(n, 3).tolist()]
            if n < REAP:
                return out

    def busy(self) -> float:
        """Seconds with at least one read in flight since the pool opened."""
        return self._lib.pio_busy(self._pool)

    def pause(self, paused: bool) -> None:
        """For tests: while paused, no reader takes a queued read."""
        self._lib.pio_pause(self._pool, int(paused))

    def close(self, timeout: float) -> bool:
        """Drops the queued reads and ends the threads; waits up to `timeout` s for the reads in flight. Whether
        none is left in flight (else their memory must be kept: they still write into it)."""
        if self._closed:
            return True
        self._closed = True
        return bool(self._lib.pio_close(self._pool, timeout))
