"""LFRU's vectorised victim choice against the per-candidate Python reference (`naive_victim`)."""

import random

import pytest

from localmoe.paging.policy import LFRU


def run(policy: LFRU, layers: int, experts: int, slots: int, tokens: int, top_k: int, seed: int,
        naive: bool) -> list:
    """Replay a random skewed routing trace; the eviction sequence the policy chose."""
    rng = random.Random(seed)
    weights = [1.0 / (e + 1) ** 0.8 for e in range(experts)]
    resident, evicted = set(), []
    for step in range(tokens):
        for layer in range(layers):
            for e in set(rng.choices(range(experts), weights, k=top_k)):
                key = (layer, e)
                if key not in resident:
                    if len(resident) >= slots:
                        cands = sorted(resident) if rng.random() < 0.5 else list(resident)
                        v = (policy.naive_victim if naive else policy.victim)(cands, step)
                        if not naive:
                            assert v == policy.naive_victim(cands, step)  # same state, same victim
                        resident.discard(v)
                        policy.evict(v)
                        evicted.append(v)
                    if rng.random() < 0.05:  # a prefetch of a never-accessed expert
                        other = (layer, rng.randrange(experts))
                        if other not in resident and len(resident) < slots:
                            resident.add(other)
                            policy.insert(other, step)
                    resident.add(key)
                    policy.insert(key, step)
                policy.access(key, step)
    return evicted


@pytest.mark.parametrize("layers,experts,slots,tokens,options", [
    (1, 8, 3, 200, {}),
    (3, 16, 12, 150, {}),
    (4, 32, 40, 120, {"half_life": 2.0, "reuse_prior": 1.0}),  # rebases the weights several times
    (2, 64, 30, 100, {"popularity_tokens": 50.0}),
])
def test_lfru_victims_match_the_python_reference(layers, experts, slots, tokens, options):
    for seed in range(3):
        if "popularity_tokens" in options:
            rng = random.Random(seed)
            options = {**options, "popularity": {(la, e): rng.random() * 0.5 for la in range(layers)
                                                  for e in range(experts) if rng.random() < 0.7}}
        fast = run(LFRU(**options), layers, experts, slots, tokens, 4, seed, naive=False)
        slow = run(LFRU(**options), layers, experts, slots, tokens, 4, seed, naive=True)
        assert len(fast) > tokens // 2  # the trace really evicts
        assert fast == slow


@pytest.mark.parametrize("name", ["lfru", "lru", "lfu"])
def test_victims_at_once_are_the_victims_one_after_another(name):
    """`victims(candidates, now, n)` (the pager's routing hints pick a layer's victims in one call) equals n
    `victim` calls, each pick taken out of the candidates before the next."""
    from localmoe.paging.policy import make_policy

    rng = random.Random(5)
    policy = make_policy(name)
    for step in range(60):
        for layer in range(3):
            for e in set(rng.choices(range(24), [1.0 / (i + 1) for i in range(24)], k=4)):
                policy.access((layer, e), step)
        cands = [(rng.randrange(3), rng.randrange(24)) for _ in range(30)]
        cands = list(dict.fromkeys(cands + [(0, 99)]))  # one never accessed
        n = rng.randrange(1, 8)
        left, one_by_one = list(cands), []
        for _ in range(n):
            one_by_one.append(policy.victim(left, step))
            left.remove(one_by_one[-1])
        assert policy.victims(cands, step, n) == one_by_one


@pytest.mark.parametrize("name", ["lfru", "lru", "lfu"])
def test_pool_victims_are_the_victims_among_the_pool(name):
    """The policy's copy of the pager's eviction pool (joined and left as slots change state; LFRU keeps it as a
    mask over its rows and its per-layer terms between calls) gives the victims `victim` picks one after another
    among the pool's keys, also right after accesses (stale per-layer terms) and rebases (half_life 2)."""
    from localmoe.paging.policy import make_policy

    rng = random.Random(7)
    policy = make_policy(name, **({"half_life": 2.0} if name == "lfru" else {}))
    for step in range(80):
        for layer in range(4):
            for e in set(rng.choices(range(24), [1.0 / (i + 1) for i in range(24)], k=4)):
                policy.access((layer, e), step)
            for _ in range(6):
                key = (rng.randrange(4), rng.randrange(26))  # some never accessed
                (policy.join_pool if rng.random() < 0.6 else policy.leave_pool)(key)
            n = rng.randrange(1, 12)
            left, one_by_one = list(policy.pool), []
            while left and len(one_by_one) < n:
                one_by_one.append(policy.victim(left, step))
                left.remove(one_by_one[-1])
            assert policy.pool_victims(step, n) == one_by_one
