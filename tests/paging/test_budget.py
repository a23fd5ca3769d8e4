"""The RAM budget is honoured, page cache included: generation under 25% of the expert bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from localmoe.convert import convert
from localmoe.paging import expert_bytes
from localmoe.paging.budget import MemoryCgroup, cgroup_writable
from localmoe.store.packed import PackedStore
from localmoe.testing import write_checkpoint

SLACK = 24 << 20  # allocator churn (one expert's float temporaries are ~7 MB here); the store has ~120 MB


@pytest.fixture(scope="module")
def small_store(private_tmp):
    root = private_tmp / "budget"
    src = write_checkpoint("gpt_oss", root / "src", size="small", seed=2)
    convert(src, root / "small.lmoe")
    return root / "small.lmoe"


def _child(store, mode, provider, budget):
    name = f"localmoe-test-{os.getpid()}-{provider}"
    try:
        out = subprocess.run([sys.executable, str(Path(__file__).with_name("budget_child.py")), str(store), mode,
                              provider, str(budget), str(SLACK), name], capture_output=True, text=True, timeout=600,
                             check=False)
    finally:
        if mode == "cgroup":
            MemoryCgroup(name).remove()
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _budget(store_path):
    store = PackedStore(store_path)
    total = expert_bytes(store)
    assert total > 8 * SLACK // 2  # the experts dwarf the slack: the test can tell the two apart
    return total // 4


@pytest.mark.skipif(not cgroup_writable(), reason="needs a writable cgroup v1 memory controller (root)")
def test_cgroup_limit_25_percent(small_store):
    budget = _budget(small_store)
    paged = _child(small_store, "cgroup", "pager", budget)
    assert paged["bytes_read"] > budget  # it really paged: more was read than fits
    assert paged["failcnt"] == 0, paged  # never reached the limit: nothing had to be reclaimed
    assert paged["max_usage"] <= paged["limit"]
    assert paged["expert_cache"] <= SLACK // 4  # no second copy of the experts in the page cache
    control = _child(small_store, "cgroup", "mmap", budget)
    assert control["failcnt"] > 0, control  # unbudgeted mmap paging runs into the same limit


def test_rss_and_mincore_25_percent(small_store):
    budget = _budget(small_store)
    paged = _child(small_store, "rss", "pager", budget)
    assert paged["peak_rss_cache"] <= paged["limit"], paged
    assert paged["expert_cache"] <= SLACK // 4
    control = _child(small_store, "rss", "mmap", budget)
    assert control["peak_rss_cache"] > control["limit"], control
