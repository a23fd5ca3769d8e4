"""Paging through the command line, as a user runs it: a tiny gpt-oss checkpoint generated and
converted with the CLI, then `localmoe run` on the store with and without a pager."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from localmoe.paging import expert_bytes
from localmoe.store.packed import PackedStore


def localmoe(*args):
    done = subprocess.run([sys.executable, "-m", "localmoe", *args], capture_output=True, text=True, timeout=300,
                          check=False)
    return done


@pytest.fixture(scope="module")
def store(private_tmp):
    root = private_tmp / "cli"
    root.mkdir()
    made = subprocess.run([sys.executable, "-m", "localmoe.testing", "gpt_oss", str(root / "src"), "--size", "tiny",
                           "--seed", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert made.returncode == 0, made.stderr
    converted = localmoe("convert", str(root / "src"), str(root / "store"))
    assert converted.returncode == 0, converted.stderr
    return root / "store"


def run_json(store, *flags):
    done = localmoe("run", "Name three colours.", "-m", str(store), "--temperature", "0", "--max-tokens", "6",
                    "--json", "--stats", *flags)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout), done.stderr


def test_one_slot_pager_gives_the_resident_tokens_and_counts(store):
    packed = PackedStore(store)
    slot = max(packed.layout(layer).slot_bytes for layer in packed.layers())
    resident, resident_err = run_json(store)
    assert "paging" not in resident and "paging: off" in resident_err
    assert f"[CPU kernels: {resident['cpu_kernels']}]" in resident_err  # the ISA and threads, or why torch runs
    for flags in (["--ram", str(slot)], ["--ram", str(slot), "--io", "mmap", "--policy", "lru", "--no-prefetch"]):
        paged, err = run_json(store, *flags)
        assert paged["text"] == resident["text"], flags
        stats = paged["paging"]
        assert stats["slots"] == 1
        assert stats["policy"] == (flags[flags.index("--policy") + 1] if "--policy" in flags else "lfru")
        assert stats["backend"] == (flags[flags.index("--io") + 1] if "--io" in flags else "odirect")
        ram = stats["tiers"]["ram"]
        # a single slot holds no expert twice in a row across layers: (almost) every request misses
        assert ram["misses"] > 0 and ram["hits"] + ram["misses"] >= 6 * len(packed.layers())
        assert ram["bytes_read"] >= ram["loads"] * 4096
        assert f"({ram['hits']}/{ram['hits'] + ram['misses']})" in err  # the --stats line agrees with the JSON


def test_percent_budget_is_of_the_store_expert_bytes(store):
    packed = PackedStore(store)
    slot = max(packed.layout(layer).slot_bytes for layer in packed.layers())
    paged, _ = run_json(store, "--ram", "50%")
    assert paged["paging"]["slots"] == expert_bytes(packed) // 2 // slot
    assert paged["paging"]["tiers"]["ram"]["hits"] > 0  # half the experts resident: some requests hit


def test_bad_paging_flags_fail_cleanly(store, private_tmp):
    done = localmoe("run", "hi", "-m", str(store), "--ram", "100")
    assert done.returncode == 1 and "Traceback" not in done.stderr and "--ram" in done.stderr
    done = localmoe("run", "hi", "-m", str(private_tmp / "cli" / "src"), "--ram", "25%")
    assert done.returncode == 1 and "not a packed store" in done.stderr
    done = localmoe("run", "hi", "-m", str(store), "--ram", "1M", "--policy", "belady")
    assert done.returncode == 1 and "--trace" in done.stderr


def test_expert_precision_flag_reaches_the_engine(store):
    """--expert-precision exact: paged still equals resident (at either precision, the same kernels run
    on the same bits); an unknown precision is a usage error naming the choices."""
    packed = PackedStore(store)
    slot = max(packed.layout(layer).slot_bytes for layer in packed.layers())
    resident, _ = run_json(store, "--expert-precision", "exact")
    paged, _ = run_json(store, "--expert-precision", "exact", "--ram", str(slot))
    assert paged["text"] == resident["text"]
    done = localmoe("run", "hi", "-m", str(store), "--expert-precision", "q4")
    assert done.returncode == 2 and "'q8'" in done.stderr and "'exact'" in done.stderr
