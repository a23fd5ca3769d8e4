"""Policies, the trace simulator and synthetic traces."""

from __future__ import annotations

import random

import pytest

from localmoe.paging import PagingConfig, attach, make_pager
from localmoe.paging.simulate import compare, replay
from localmoe.paging.trace import RoutingTrace, synthetic_trace

from .conftest import run_greedy


def _brute_force_optimum(keys, slots):
    """Fewest misses any eviction choice reaches (exhaustive; tiny inputs only)."""
    best = [len(keys)]

    def go(i, resident, misses):
        if misses >= best[0]:
            return
        if i == len(keys):
            best[0] = misses
            return
        k = keys[i]
        if k in resident:
            go(i + 1, resident, misses)
        elif len(resident) < slots:
            go(i + 1, resident | {k}, misses + 1)
        else:
            for v in resident:
                go(i + 1, (resident - {v}) | {k}, misses + 1)

    go(0, frozenset(), 0)
    return best[0]


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_optimal(seed):
    rng = random.Random(seed)
    keys = [(0, rng.randrange(5)) for _ in range(14)]
    acc = list(enumerate(keys))
    for slots in (1, 2, 3):
        assert replay(acc, "belady", slots).misses == _brute_force_optimum(keys, slots)
        for policy in ("lru", "lfu", "lfru"):
            assert replay(acc, policy, slots).misses >= replay(acc, "belady", slots).misses


def test_lru_textbook_sequence():
    # a b c a d b with 3 slots: LRU evicts b for d, then misses b again -> 5 misses; Belady evicts c -> 4
    seq = [(0, x) for x in [0, 1, 2, 0, 3, 1]]
    acc = list(enumerate(seq))
    assert replay(acc, "lru", 3).misses == 5
    assert replay(acc, "belady", 3).misses == 4


def test_lfu_keeps_the_popular_expert():
    seq = [(0, 0)] * 5 + [(0, 1), (0, 2), (0, 0), (0, 3), (0, 0)]
    acc = list(enumerate(seq))
    assert replay(acc, "lfu", 2).misses < replay(acc, "lru", 2).misses or replay(acc, "lfu", 2).misses == 4


def test_synthetic_trace_has_the_asked_locality():
    layers = list(range(4))
    t = synthetic_trace(layers, 64, 4, 600, reuse=0.30, zipf=1.0, seed=3)
    assert t.synthetic and "synthetic" in t.label
    assert 0.25 < t.reuse() < 0.35
    pop = sorted(t.popularity()[0], reverse=True)
    assert pop[0] > 4 * pop[len(pop) // 2]  # Zipf-skewed, not flat
    flat = synthetic_trace(layers, 64, 4, 600, reuse=0.0, zipf=0.0, seed=3)
    assert flat.reuse() < 0.15


def test_policies_on_a_skewed_trace_vs_belady():
    t = synthetic_trace(list(range(6)), 64, 4, 400, seed=1)
    slots = 6 * 64 // 4
    r = compare(t, slots)
    assert r["belady"].hit_rate >= max(r[p].hit_rate for p in ("lru", "lfu", "lfru"))
    assert r["lfru"].hit_rate > r["lru"].hit_rate  # the published ordering on skewed traffic


def test_trace_roundtrip(tmp_path):
    t = synthetic_trace([1, 3], 8, 2, 5, seed=0)
    back = RoutingTrace.load(t.save(tmp_path / "t.json"))
    assert back.accesses() == t.accesses() and back.synthetic and back.layers == [1, 3]


@pytest.mark.parametrize("policy", ["lru", "lfu", "lfru"])
def test_pager_without_prefetch_matches_the_simulator(gpt_oss, policy):
    """The live pager's hits equal a replay of the trace it produced, at the same size."""
    trace = RoutingTrace()
    store = gpt_oss.store()
    slots = len(store.layers()) * 2 + 1
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    pager = make_pager(store, PagingConfig(ram_budget=slots * slot, policy=policy, prefetch=False))
    gpt_oss.model.use_experts(pager)
    attach(gpt_oss.model, pager, trace=trace)
    run_greedy(gpt_oss.model)
    pager.close()
    sim = replay(trace.accesses(), policy, slots)
    assert (pager.stats.ram.hits, pager.stats.ram.misses) == (sim.hits, sim.misses)
    assert sim.hits > 0 and sim.misses > 0


def test_trace_records_tokens_layers_experts(gpt_oss):
    trace = RoutingTrace(num_experts=gpt_oss.loaded.spec.num_experts)
    attach(gpt_oss.model, trace=trace)
    tokens, _ = run_greedy(gpt_oss.model)
    assert trace.tokens == 8 + len(tokens)  # prompt + each decode step
    assert trace.layers == gpt_oss.loaded.spec.moe_layers()
    assert all(len(row) == gpt_oss.loaded.spec.num_experts_per_tok for s in trace.steps for rows in s.values()
               for row in rows)
    assert len(trace.decode_only().steps) == len(tokens)
    assert trace.accesses()[0][1][0] == trace.layers[0]
