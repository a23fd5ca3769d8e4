"""The native readers (C++ threads, kernels/paged_io): chosen for the plain O_DIRECT backend, the same bytes as the
store, demanded reads before guesses, an unread wrong guess cancelled (never read), and errors (short read,
checksum, timeout) naming the file and extent and reaching the waiter."""

from __future__ import annotations

import gc
import shutil

import pytest
import torch
from localmoe.kernels.paged_io import available

from localmoe.engine.experts import ExpertWeights
from localmoe.paging import PagingConfig, make_pager
from localmoe.paging.disk import MmapBackend, ODirectBackend
from localmoe.paging.errors import CorruptExpertError, PagingError, ReadTimeoutError, StoreChangedError
from localmoe.paging.pager import Pager
from localmoe.paging.policy import LRU
from localmoe.paging.readers import NativeReaders, PythonReaders
from localmoe.store.packed import ExpertExtent, PackedStore

pytestmark = pytest.mark.skipif(not available(), reason="the CPU kernel library does not build here")


def _same(store, layer, expert, w) -> bool:
    ref = ExpertWeights.from_parts(store.expert(layer, expert))
    return all(torch.equal(getattr(w, p).packed, getattr(ref, p).packed) for p in ("gate", "up", "down"))


@pytest.fixture
def store_copy(gpt_oss, tmp_path):
    dst = tmp_path / "copy.lmoe"
    shutil.copytree(gpt_oss.store_path, dst)
    return dst


def test_the_plain_odirect_backend_reads_natively(gpt_oss):
    store = gpt_oss.store()

    class Wrapped(ODirectBackend):
        def _read(self, f, offset, view):
            return super()._read(f, offset, view)

    kinds = {}
    for name, backend in {"odirect": ODirectBackend(store), "mmap": MmapBackend(store),
                          "subclass": Wrapped(store)}.items():
        pager = Pager(store, 4, LRU(), backend)
        kinds[name] = type(pager.readers)
        pager.close()
    assert kinds == {"odirect": NativeReaders, "mmap": PythonReaders, "subclass": PythonReaders}
    pager = make_pager(store, PagingConfig(ram_budget=1 << 20, io="odirect"))
    assert isinstance(pager.readers, NativeReaders)
    pager.close()


def test_native_reads_are_the_store_bytes(gpt_oss):
    """Every expert through 3 slots (constant eviction, reads in flight together) equals the store's bytes."""
    store = gpt_oss.store()
    pager = Pager(store, 3, LRU(), ODirectBackend(store), io_threads=3, native=True)
    try:
        for layer in store.layers():
            experts = store.experts_in(layer)
            for i in range(0, len(experts), 3):
                chosen = experts[i:i + 3]
                pager.begin_layer(layer, chosen)
                for e, w in zip(chosen, pager.hold(layer, chosen)):
                    assert _same(store, layer, e, w), (layer, e)
        assert pager.stats.ram.loads == sum(len(store.experts_in(layer)) for layer in store.layers())
        assert pager.stats.ram.read_seconds > 0
    finally:
        pager.close()


def test_demanded_first_and_an_unread_wrong_guess_is_cancelled(gpt_oss):
    store = gpt_oss.store()
    a, b, c = store.layers()[:3]
    pager = Pager(store, 16, LRU(), ODirectBackend(store), io_threads=1, native=True)
    finished = []
    reap = pager.readers.reap

    def logged():
        out = reap()
        finished.extend(pager._reads[read_id].key for read_id, _ in out)
        return out

    pager.readers.reap = logged
    try:
        pager.readers.pause(True)
        pager.begin_layer(a, [0], [(b, [5, 6, 7])])  # a's expert now, then the guesses for b, best first
        pager.begin_layer(c, [1])  # demanded after the guesses were queued: read before them
        pager.begin_layer(b, [6])  # b's routing: the unread guesses 5 and 7 are dropped, never read
        pf = pager.stats.prefetch
        assert (pf.issued, pf.wasted, pf.pending) == (3, 2, 1) and (b, 5) not in pager.where
        pager.readers.pause(False)
        held = pager.hold(b, [6])
        pager.hold(a, [0])
        pager.hold(c, [1])
        assert _same(store, b, 6, held[0])
        assert finished == [(a, 0), (c, 1), (b, 6)]  # one reader: demanded in order, then the used guess
        assert pager.stats.ram.loads == 3 and (pf.used, pf.wasted, pf.pending) == (1, 2, 0)
    finally:
        pager.readers.pause(False)
        pager.close()


def test_checksum_error_names_the_extent_and_reaches_the_waiter(store_copy):
    store = PackedStore(store_copy)
    ext = store.expert_extent(2, 5)
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 100)
        b = f.read(1)
        f.seek(ext.offset + 100)
        f.write(bytes([b[0] ^ 0x40]))
    store = PackedStore(store_copy)
    pager = Pager(store, 4, LRU(), ODirectBackend(store), native=True)
    try:
        pager.begin_layer(2, [4, 5])
        with pytest.raises(CorruptExpertError, match=rf"layer 2 expert 5 in .*layer-0002\.bin at offset {ext.offset}: "
                                                     r"checksum mismatch"):
            pager.hold(2, [4, 5])
        assert (2, 5) not in pager.where  # the failed read's slot is free again
        assert _same(store, 2, 4, pager.get(2, 4))
    finally:
        pager.close()


def test_short_read_names_the_extent(store_copy):
    """An extent that runs past the end of its file (the native preadv reads fewer bytes)."""
    store = PackedStore(store_copy)
    real = store.expert_extent
    size = real(1, 0).path.stat().st_size

    def extent(layer, expert):
        e = real(layer, expert)
        return ExpertExtent(e.path, size - 4096, e.nbytes, e.checksum) if (layer, expert) == (1, 0) else e

    store.expert_extent = extent
    pager = Pager(store, 4, LRU(), ODirectBackend(store), native=True)
    try:
        with pytest.raises(StoreChangedError, match=rf"layer 1 expert 0: .*layer-0001\.bin ends at {size}, before the "
                                                    rf"extent's end {size - 4096 + real(1, 0).nbytes}"):
            pager.get(1, 0)
        pager.get(1, 1)
    finally:
        pager.close()


def test_native_read_timeout_retires_the_slot(gpt_oss):
    store = gpt_oss.store()
    pager = Pager(store, 4, LRU(), ODirectBackend(store), timeout=0.3, native=True)
    try:
        pager.readers.pause(True)  # the read is queued but never taken: it does not finish in time
        with pytest.raises(ReadTimeoutError, match=r"layer 1 expert 0: reading .*layer-0001\.bin at offset \d+ did "
                                                   r"not finish within 0.3 s"):
            pager.get(1, 0)
        pager.readers.pause(False)
        assert _same(store, 1, 1, pager.get(1, 1))  # the pager goes on; the late read changes nothing
        assert pager.lost_slots == 1 and (1, 0) not in pager.resident()
        assert _same(store, 1, 0, pager.get(1, 0))
    finally:
        pager.readers.pause(False)
        pager.close()


@pytest.mark.parametrize("native", [True, False])
def test_a_read_after_close_fails_at_once(gpt_oss, native):
    store = gpt_oss.store()
    pager = Pager(store, 4, LRU(), ODirectBackend(store), native=native)
    pager.get(1, 0)
    pager.close()
    with pytest.raises(PagingError, match="the pager was closed"):
        pager.get(1, 1)


def test_a_pager_dropped_with_reads_queued_and_in_flight(gpt_oss):
    """The native readers write into the slab: a pager dropped without `close` waits for its reads in flight before
    its slab goes (a read into freed memory would crash the process or corrupt another's)."""
    store = gpt_oss.store()
    for _ in range(5):
        pager = Pager(store, 64, LRU(), ODirectBackend(store), native=True)
        for layer in store.layers():
            pager.begin_layer(layer, store.experts_in(layer)[:8])
        del pager
        gc.collect()
    pager = Pager(store, 4, LRU(), ODirectBackend(store), native=True)
    assert _same(store, 1, 1, pager.get(1, 1))
    pager.close()
