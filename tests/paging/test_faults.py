"""Faults while paging: corrupt extents, hung and failing reads, deleted or replaced store files."""

from __future__ import annotations

import errno
import os
import shutil
import threading
import time

import pytest

from localmoe.paging import PagingConfig, make_pager
from localmoe.paging.disk import ODirectBackend
from localmoe.paging.errors import CorruptExpertError, PagingError, ReadTimeoutError, StoreChangedError
from localmoe.paging.pager import Pager
from localmoe.paging.policy import LRU
from localmoe.store.packed import PackedStore

from .conftest import run_greedy


@pytest.fixture
def store_copy(gpt_oss, tmp_path):
    dst = tmp_path / "copy.lmoe"
    shutil.copytree(gpt_oss.store_path, dst)
    return dst


def _pager(path, io="odirect", slots_budget=1 << 20, **kw):
    return make_pager(PackedStore(path), PagingConfig(ram_budget=slots_budget, io=io, **kw))


def _flip(path, layer, expert):
    store = PackedStore(path)
    ext = store.expert_extent(layer, expert)
    with open(ext.path, "r+b") as f:
        f.seek(ext.offset + 100)
        b = f.read(1)
        f.seek(ext.offset + 100)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("io", ["odirect", "mmap"])
def test_corrupt_extent_names_layer_and_expert(store_copy, io):
    _flip(store_copy, 2, 5)
    pager = _pager(store_copy, io)
    pager.get(2, 4)  # a sound neighbour still loads
    with pytest.raises(CorruptExpertError, match=r"layer 2 expert 5 in .*layer-0002\.bin at offset \d+: checksum"):
        pager.get(2, 5)
    pager.close()


def test_corrupt_extent_during_generation(gpt_oss, store_copy):
    store = PackedStore(store_copy)
    for e in store.experts_in(1):
        _flip(store_copy, 1, e)
    pager = _pager(store_copy)
    gpt_oss.model.use_experts(pager)
    with pytest.raises(CorruptExpertError, match=r"layer 1 expert \d+"):
        run_greedy(gpt_oss.model)
    pager.close()


def test_corrupt_prefetch_costs_only_bandwidth(store_copy):
    _flip(store_copy, 1, 3)
    pager = _pager(store_copy)
    assert pager.prefetch(1, [3]) == 1
    deadline = time.monotonic() + 10
    while pager.stats.prefetch.wasted == 0 and time.monotonic() < deadline:
        pager.resident()  # the pager takes in the finished reads whenever it is entered
        time.sleep(0.01)
    assert pager.stats.prefetch.wasted == 1 and (1, 3) not in pager.resident()
    pager.get(1, 2)
    with pytest.raises(CorruptExpertError, match="layer 1 expert 3"):  # demanded: read again, and it raises
        pager.get(1, 3)
    pager.close()


class _Hanging(ODirectBackend):
    def __init__(self, store, release: threading.Event):
        super().__init__(store)
        self.release = release

    def _read(self, f, offset, view):
        self.release.wait()
        return super()._read(f, offset, view)


def test_hung_read_times_out(store_copy):
    store = PackedStore(store_copy)
    release = threading.Event()
    pager = Pager(store, 4, LRU(), _Hanging(store, release), timeout=0.3)
    started = time.monotonic()
    with pytest.raises(ReadTimeoutError, match=r"layer 1 expert 0: reading .* did not finish within 0.3 s"):
        pager.get(1, 0)
    assert time.monotonic() - started < 3
    release.set()
    pager.get(1, 1)  # the pager goes on; the hung slot is retired
    assert pager.lost_slots == 1
    pager.close()


class _HangingOne(ODirectBackend):
    """Reads of expert `expert` wait for `release`; the others go on."""

    def __init__(self, store, expert: int, release: threading.Event):
        super().__init__(store)
        self.expert, self.release = expert, release

    def read(self, layer, expert, out):
        if expert == self.expert:
            self.release.wait()
        return super().read(layer, expert, out)


def test_a_held_layer_whose_read_hangs_times_out(store_copy):
    """`hold` waits for its experts' reads together: the hung one is named and its slot retired, the others are in."""
    store = PackedStore(store_copy)
    release = threading.Event()
    pager = Pager(store, 4, LRU(), _HangingOne(store, 1, release), timeout=0.3, native=False)
    with pytest.raises(ReadTimeoutError, match=r"layer 1 expert 1: reading .* did not finish within 0.3 s"):
        pager.hold(1, [0, 1, 2])
    assert pager.lost_slots == 1 and {(1, 0), (1, 2)} <= pager.resident()
    release.set()
    assert len(pager.hold(1, [0, 2])) == 2  # the pager goes on
    pager.close()


class _Failing(ODirectBackend):
    def _read(self, f, offset, view):
        raise OSError(errno.EIO, os.strerror(errno.EIO))


def test_io_error_surfaces(store_copy):
    store = PackedStore(store_copy)
    pager = Pager(store, 2, LRU(), _Failing(store), timeout=5)
    with pytest.raises(PagingError, match=r"layer 3 expert 1: reading .*layer-0003\.bin at offset \d+ failed "
                                          r"\(Input/output error\)"):
        pager.get(3, 1)
    pager.close()


@pytest.mark.parametrize("io", ["odirect", "mmap"])
def test_deleted_store_file(store_copy, io):
    pager = _pager(store_copy, io)
    pager.get(1, 0)
    os.unlink(store_copy / "experts" / "layer-0001.bin")
    with pytest.raises(StoreChangedError, match=r"layer-0001\.bin was deleted"):
        pager.get(1, 1)
    pager.close()


@pytest.mark.parametrize("io", ["odirect", "mmap"])
def test_replaced_store_file(store_copy, io):
    pager = _pager(store_copy, io)
    pager.get(2, 0)
    path = store_copy / "experts" / "layer-0002.bin"
    shutil.copyfile(path, path.with_suffix(".new"))
    os.replace(path.with_suffix(".new"), path)
    with pytest.raises(StoreChangedError, match=r"layer-0002\.bin was replaced"):
        pager.get(2, 1)
    pager.close()


def test_budget_too_small(store_copy):
    with pytest.raises(PagingError, match="holds no expert slot"):
        _pager(store_copy, slots_budget=4096)
