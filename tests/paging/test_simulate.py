"""Policies, the trace simulator and synthetic traces."""

from __future__ import annotations

import random

import pytest

from localmoe.paging import PagingConfig, PagingError, attach, make_pager
from localmoe.paging.policy import LFRU, popularity
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
    assert r["lfru"].hit_rate > r["lfu"].hit_rate > r["lru"].hit_rate  # the published ordering on skewed traffic


def _profile(t):
    return popularity([(layer, e, int(c)) for layer, cs in t.popularity().items() for e, c in enumerate(cs)], t.tokens)


@pytest.mark.parametrize("fraction, profiled", [(0.50, False), (0.25, True)], ids=["50%", "25%-profiled"])
def test_lfru_reaches_nine_tenths_of_belady_on_the_locality_trace(fraction, profiled):
    """The issue's goal on the SYNTHETIC locality trace (~30% reuse, Zipf s=1; gpt-oss-large's 12 x 128
    experts, top-4, 400 tokens). Without a profile LFRU reaches it at half the experts (0.93); at a
    quarter it needs a calibration profile (another run of the same model) to rank cold experts."""
    layers, experts = list(range(12)), 128
    t = synthetic_trace(layers, experts, 4, 400, seed=0)
    slots = int(len(layers) * experts * fraction)
    options = {}
    if profiled:
        cal = synthetic_trace(layers, experts, 4, 400, seed=0, draws=1)
        options = {"popularity": _profile(cal), "popularity_tokens": cal.tokens}
    acc = t.accesses()
    assert replay(acc, "lfru", slots, **options).hit_rate >= 0.9 * replay(acc, "belady", slots).hit_rate


@pytest.mark.parametrize("seed", [0, 1])
def test_lfru_keeps_up_with_lfu_on_flat_routing_with_a_fixed_skew(seed):
    """Random-weight routers: little reuse (~8%) and a persistent per-expert bias (mild Zipf,
    s=0.5), so the popularity count is all there is to know. LFRU must not fall behind LFU
    (it did by 0.07 x Belady when a just-used rare expert's reuse was shrunk to the layer's
    mean, which the popular experts dominate)."""
    t = synthetic_trace(list(range(6)), 64, 4, 400, reuse=0.08, zipf=0.5, seed=seed)
    acc, slots = t.accesses(), 6 * 64 // 4
    assert replay(acc, "lfru", slots).hit_rate >= replay(acc, "lfu", slots).hit_rate - 0.01 * replay(
        acc, "belady", slots).hit_rate


def test_lfru_ranks_by_the_chance_of_use_in_the_next_pass():
    p = LFRU()
    for step in range(40):  # expert 0: every other pass (popular, never twice running); 1: always
        if step % 2 == 0:
            p.access((0, 0), step)
        p.access((0, 1), step)
    p.access((0, 2), 40)  # expert 2: once, in the latest pass
    p.access((0, 1), 40)
    assert p.recent((0, 2)) and not p.recent((0, 0)) and p.recent((0, 1))
    assert p.next_use((0, 1)) > 0.75  # reused every pass (believed over ~reuse_prior = 32 uses)
    assert 0.8 < p.next_use((0, 0))  # popular but not recent: above LRU's first-evicted place ...
    assert p.next_use((0, 2)) < p.next_use((0, 0))  # ... and above the once-seen recent expert
    assert p.victim([(0, 0), (0, 1), (0, 2)], 40) == (0, 2)


def test_lfru_pending_pass_keeps_the_previous_pass():
    p = LFRU()
    for step in range(3):
        p.access((1, 5), step)
    p.access((0, 3), 3)  # step 3 has begun at layer 0; layer 1's pass is still to come
    assert p.recent((1, 5))
    p.access((1, 7), 3)  # layer 1's pass 3 is in progress: 5 may still be asked for
    assert p.recent((1, 5))
    p.access((2, 0), 3)  # layer 1's pass 3 is over without 5
    assert not p.recent((1, 5))


def test_lfru_ages_old_popularity():
    def run(half_life):
        p = LFRU(half_life=half_life)
        for step in range(62):
            p.access((0, 9), step)
            if step < 40 and step % 2 == 0:
                p.access((0, 0), step)  # popular early
            if 40 <= step < 60 and step % 4 == 0:
                p.access((0, 1), step)  # less popular, lately
        return p.next_use((0, 0)) > p.next_use((0, 1))

    assert run(1e9) and not run(4.0)


def test_lfru_rebases_weights_without_overflow():
    p = LFRU(half_life=1.0, reuse_prior=1.0)  # a one-pass half-life keeps ~2 passes of data: a prior as short
    for step in range(3000):  # 2^3000 overflows a float without rebasing
        p.access((0, step % 3), step)
    assert p.base > 0 and 0.0 <= p.next_use((0, 1)) <= 1.0
    # 0 comes next in the cycle; 1 and 2 never repeat back to back, so the older of them goes
    assert p.victim([(0, 0), (0, 1), (0, 2)], 2999) == (0, 1)


def test_lfru_takes_a_calibration_profile_as_prior():
    prof = popularity([(0, 0, 90), (0, 1, 5), (0, 2, 5)], 100)
    assert prof[(0, 0)] == pytest.approx(0.9)
    cold, warm = LFRU(), LFRU(popularity=prof, popularity_tokens=100)
    for p in (cold, warm):
        p.access((0, 1), 0)
        p.access((0, 2), 1)
        p.access((1, 0), 1)  # layer 0's pass is over: neither 0 nor 1 is recent
    assert cold.next_use((0, 0)) < cold.next_use((0, 1))
    assert warm.next_use((0, 0)) > warm.next_use((0, 1))
    with pytest.raises(PagingError):
        LFRU(half_life=0)
    with pytest.raises(PagingError):
        popularity([], 0)


def test_synthetic_draws_are_another_run_of_the_same_model():
    a = synthetic_trace([0], 32, 2, 300, seed=4)
    b = synthetic_trace([0], 32, 2, 300, seed=4, draws=9)
    assert a.keys() != b.keys()
    hot_a, hot_b = ({int(e) for e in t.popularity()[0].argsort()[-3:]} for t in (a, b))
    assert len(hot_a & hot_b) >= 2
    assert synthetic_trace([0], 32, 2, 50, seed=4).keys() == synthetic_trace([0], 32, 2, 50, seed=4).keys()


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
