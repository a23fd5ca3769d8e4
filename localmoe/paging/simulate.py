"""Replay a routing trace against a cache policy at a given number of slots (no I/O).

Demand paging exactly as the pager does it without prefetch: a request for a resident
expert is a hit; a miss evicts the policy's victim when the slots are full. Belady's MIN
replayed this way is the optimum any policy can reach at that size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localmoe.paging.policy import POLICIES, Key, make_policy
from localmoe.paging.trace import RoutingTrace


@dataclass
class Replay:
    policy: str
    slots: int
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses) if self.hits + self.misses else 0.0


def replay(accesses: Sequence[tuple[int, Key]], policy: str, slots: int, pinned: Sequence[Key] = (),
           **options) -> Replay:
    """Hits and misses of `policy` over `accesses` ((step, key) pairs) with `slots` slots."""
    keys = [key for _, key in accesses]
    pol = make_policy(policy, trace=keys, **options)
    pinned = set(list(pinned)[:slots // 2])
    resident: set[Key] = set(pinned)
    hits = misses = 0
    for step, key in accesses:
        if key in resident:
            hits += 1
        else:
            misses += 1
            if len(resident) >= slots:
                victim = pol.victim([k for k in resident if k not in pinned], step)
                resident.discard(victim)
                pol.evict(victim)
            resident.add(key)
            pol.insert(key, step)
        pol.access(key, step)
    return Replay(policy, slots, hits, misses)


def compare(trace: RoutingTrace, slots: int, policies: Sequence[str] = POLICIES) -> dict[str, Replay]:
    """Every policy (Belady included) replayed over `trace` at `slots`."""
    acc = trace.accesses()
    return {p: replay(acc, p, slots) for p in policies}
