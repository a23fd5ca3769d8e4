"""The pager's readers: the threads that read expert extents into RAM slots, off the compute thread.

The pager (pager.py) submits a read by id, urgent (demanded, or a routed layer's) or not (a lookahead guess), and
learns what finished only when it asks (`reap`, on the compute thread): the readers never take the pager's lock.
A reader takes one lock per read, to record it and take the next one (urgent reads first, each kind in submission
order). `cancel` drops a read no reader took yet; `wait` blocks until one read is finished, `wait_any` until some
read is; `busy` is the seconds with at least one read in flight. A read submitted after `close` fails at once
(PagingError).

Two implementations, the same contract:
- `NativeReaders`: the plain O_DIRECT backend's reads (`DiskBackend.native`) on C++ threads (kernels/paged_io):
  preadv, the file identity check and the xxh3_64 check run without the interpreter lock, so reads do not take
  turns with compute for it; their results are codes `DiskBackend.failure` turns into the backend's own errors.
- `PythonReaders`: any backend's `read` on Python threads (mmap, test backends, or where the CPU library does
  not build).
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from localmoe.errors import LocalMoEError
from localmoe.paging.disk import OK, DiskBackend
from localmoe.paging.errors import PagingError
from localmoe.paging.policy import Key
from localmoe.paging.slab import HostSlab

Finished = tuple[int, BaseException | None]  # (read id, its error or None)
_OUTLIVING: list = []  # slabs that native reads still in flight at `close` write into: kept for good


def _closed() -> PagingError:
    return PagingError("the pager was closed; load the model again to read more experts")


class PythonReaders:
    """Up to `threads` Python threads (started as reads come) running `backend.read` into `slab`'s slots."""

    def __init__(self, backend: DiskBackend, slab: HostSlab, threads: int):
        self.backend, self.slab, self.threads = backend, slab, threads
        lock = threading.Lock()
        self._work, self._done = threading.Condition(lock), threading.Condition(lock)
        self._urgent: deque[tuple[int, Key, int]] = deque()
        self._later: deque[tuple[int, Key, int]] = deque()
        self._pending: set[int] = set()  # queued or being read
        self._finished: list[Finished] = []
        self._workers: list[threading.Thread] = []
        self._inflight, self._since, self._busy, self._closed = 0, 0.0, 0.0, False

    def submit(self, read_id: int, key: Key, slot: int, urgent: bool) -> None:
        with self._work:
            if self._closed:
                self._finished.append((read_id, _closed()))
                return
            (self._urgent if urgent else self._later).append((read_id, key, slot))
            self._pending.add(read_id)
            if len(self._workers) < self.threads:
                self._workers.append(threading.Thread(target=self._reader, daemon=True,
                                                      name=f"localmoe-io-{len(self._workers)}"))
                self._workers[-1].start()
            self._work.notify()

    def cancel(self, read_id: int) -> bool:
        with self._work:
            for queue in (self._later, self._urgent):
                for item in queue:
                    if item[0] == read_id:
                        queue.remove(item)
                        self._pending.discard(read_id)
                        return True
        return False

    def wait(self, read_id: int, timeout: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: read_id not in self._pending, timeout)

    def wait_any(self, timeout: float) -> bool:
        with self._done:
            return self._done.wait_for(lambda: bool(self._finished), timeout)

    def reap(self) -> list[Finished]:
        with self._work:
            out, self._finished = self._finished, []
        return out

    def busy(self) -> float:
        with self._work:
            return self._busy + (time.perf_counter() - self._since if self._inflight else 0.0)

    def _reader(self) -> None:
        lock = self._work
        lock.acquire()
        try:
            while True:
                while not (self._urgent or self._later or self._closed):
                    self._work.wait()
                if self._closed:
                    return
                read_id, key, slot = (self._urgent or self._later).popleft()
                if self._inflight == 0:
                    self._since = time.perf_counter()
                self._inflight += 1
                lock.release()
                error = None
                try:
                    self.backend.read(key[0], key[1], self.slab.slot(slot))
                except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the read
                    error = e
                lock.acquire()  # once per read: record it, then take the next
                self._inflight -= 1
                if self._inflight == 0:
                    self._busy += time.perf_counter() - self._since
                self._pending.discard(read_id)
                self._finished.append((read_id, error))
                self._done.notify_all()
        finally:
            lock.release()

    def close(self, timeout: float) -> None:
        """Drops the queued reads; the threads end (a read in flight finishes first: the threads hold the slab)."""
        with self._work:
            self._closed = True
            self._urgent.clear()
            self._later.clear()
            self._pending.clear()
            self._work.notify_all()
            self._done.notify_all()


class NativeReaders:
    """The C++ reader pool (kernels/paged_io) doing `backend`'s O_DIRECT reads into `slab`'s slots."""

    def __init__(self, backend: DiskBackend, slab: HostSlab, threads: int):
        from localmoe.kernels.paged_io import ReaderPool

        self.backend, self.slab, self.threads = backend, slab, threads
        self._pool = ReaderPool(threads)
        self._base = slab.array.ctypes.data
        self._files: dict[os.PathLike, int] = {}  # path -> the pool's index of the open file
        self._extents: dict[Key, tuple[int, int, int, int]] = {}  # key -> (file index, offset, bytes, checksum)
        self._keys: dict[int, Key] = {}  # read id -> its expert, until reaped or cancelled
        self._failed: list[Finished] = []  # reads that failed before reaching the pool (opening the file)
        self._closed = False

    def _extent(self, key: Key) -> tuple[int, int, int, int]:
        ext = self._extents.get(key)
        if ext is None:
            e = self.backend.store.expert_extent(*key)
            index = self._files.get(e.path)
            if index is None:
                f = self.backend.file(e.path)
                index = self._files[e.path] = self._pool.file(f.fd, str(f.path), *f.ident)
            ext = self._extents[key] = (index, e.offset, e.nbytes, e.checksum)
        return ext

    def submit(self, read_id: int, key: Key, slot: int, urgent: bool) -> None:
        if self._closed:
            self._failed.append((read_id, _closed()))
            return
        try:
            file, offset, nbytes, checksum = self._extent(key)
        except LocalMoEError as e:  # the file cannot be opened: the read fails, for whoever waits for it
            self._failed.append((read_id, e))
            return
        self._keys[read_id] = key
        self._pool.submit(read_id, file, offset, nbytes, self._base + slot * self.slab.slot_bytes, checksum,
                          self.backend.verify, urgent)

    def cancel(self, read_id: int) -> bool:
        if self._pool.cancel(read_id):
            del self._keys[read_id]
            return True
        return False

    def wait(self, read_id: int, timeout: float) -> bool:
        return self._pool.wait(read_id, timeout)

    def wait_any(self, timeout: float) -> bool:
        return bool(self._failed) or self._pool.wait_any(timeout)

    def reap(self) -> list[Finished]:
        out, self._failed = self._failed, []
        for read_id, code, detail in self._pool.reap():
            key = self._keys.pop(read_id)
            out.append((read_id, None if code == OK else self.backend.failure(key[0], key[1], code, detail)))
        return out

    def busy(self) -> float:
        return self._pool.busy()

    def pause(self, paused: bool) -> None:
        """For tests: while paused, no reader takes a queued read."""
        self._pool.pause(paused)

    def close(self, timeout: float) -> None:
        """Drops the queued reads and ends the threads, waiting up to `timeout` s for the reads in flight; where
        one is still in flight (a hung disk) the slab it writes into is kept for good."""
        if not self._closed:
            self._closed = True
            if not self._pool.close(timeout):
                _OUTLIVING.append(self.slab)

    def __del__(self) -> None:  # a pager dropped without `close`: its slab must outlive the reads in flight
        if not getattr(self, "_closed", True):
            self.close(30.0)


def make_readers(backend: DiskBackend, slab: HostSlab, threads: int, native: bool | None = None):
    """`NativeReaders` where the backend allows them (`DiskBackend.native`) and the CPU library runs, else
    `PythonReaders`; `native` True or False forces one (True: the native ones, or an error if they cannot run)."""
    if native is None:
        from localmoe.kernels.paged_io import available

        native = backend.native() and available()
    return (NativeReaders if native else PythonReaders)(backend, slab, threads)
