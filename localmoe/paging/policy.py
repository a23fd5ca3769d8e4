"""Cache policies: which resident expert to evict. Keys are (layer, expert) pairs.

A policy sees every demand access (`access(key, now)`, `now` in decode steps, i.e.
tokens), every insertion and eviction, and picks a victim from the candidates the pager
allows (`victim`). The pager owns the slots; a policy only ranks keys.

- LRU: least recently used.
- LFU: fewest accesses ever (counts survive eviction, so a popular expert that was pushed
  out comes back ranked high); ties broken by recency.
- LFRU: frequency + recency: experts used in the last step are kept first (next-token
  reuse), then the lowest slowly-decaying frequency score (LRFU-style) is evicted.
- Belady: the offline optimum (MIN) over a recorded access sequence: evict the key used
  furthest in the future. For measurement; the run must follow the trace it was given.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Sequence

from localmoe.paging.errors import PagingError

Key = tuple[int, int]  # (layer, expert)
POLICIES = ("lru", "lfu", "lfru", "belady")


class Policy:
    name = "base"

    def access(self, key: Key, now: int) -> None:
        """A demand access to `key` at step `now` (hit or miss)."""

    def insert(self, key: Key, now: int) -> None:
        """`key` became resident (a demand load or a prefetch)."""

    def evict(self, key: Key) -> None:
        """`key` left the cache."""

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        raise NotImplementedError


class LRU(Policy):
    name = "lru"

    def __init__(self) -> None:
        self.order: OrderedDict[Key, None] = OrderedDict()  # least recent first

    def access(self, key: Key, now: int) -> None:
        self.order[key] = None
        self.order.move_to_end(key)

    def insert(self, key: Key, now: int) -> None:
        if key not in self.order:
            self.order[key] = None

    def evict(self, key: Key) -> None:
        self.order.pop(key, None)

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        allowed = set(candidates)
        for key in self.order:
            if key in allowed:
                return key
        return next(iter(allowed))


class LFU(Policy):
    name = "lfu"

    def __init__(self) -> None:
        self.count: defaultdict[Key, int] = defaultdict(int)
        self.last: dict[Key, int] = {}
        self.clock = 0

    def access(self, key: Key, now: int) -> None:
        self.clock += 1
        self.count[key] += 1
        self.last[key] = self.clock

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return min(candidates, key=lambda k: (self.count[k], self.last.get(k, 0)))


class LFRU(Policy):
    """Frequency + recency: experts used in the last `window` steps (the ~30% next-token reuse)
    are evicted only after all others; among equals the lowest frequency score goes, where
    each access adds 1 to a score that halves every `half_life` steps (LRFU's combined
    recency-frequency value, Lee et al. 2001, with slow aging so popularity can drift).

    Scores are stored as log2 referred to step 0, so ranking needs no decay pass."""

    name = "lfru"

    def __init__(self, half_life: float = 256.0, window: int = 1) -> None:
        if half_life <= 0 or window < 0:
            raise PagingError(f"LFRU needs half_life > 0 and window >= 0 steps, not {half_life}, {window}")
        self.half_life, self.window = half_life, window
        self.log_score: dict[Key, float] = {}
        self.last: dict[Key, int] = {}

    def access(self, key: Key, now: int) -> None:
        self.last[key] = now
        bump = now / self.half_life  # log2 of 2^(now/h): one access at `now`, referred to step 0
        old = self.log_score.get(key)
        if old is None:
            self.log_score[key] = bump
        else:  # log2(2^old + 2^bump), computed stably
            hi, lo = max(old, bump), min(old, bump)
            self.log_score[key] = hi + math.log2(1.0 + 2.0 ** (lo - hi))

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return min(candidates, key=lambda k: (self.last.get(k, -1 << 62) >= now - self.window,
                                              self.log_score.get(k, -math.inf)))


class Belady(Policy):
    """MIN over `future`, the exact sequence of demand accesses the run will make."""

    name = "belady"

    def __init__(self, future: Sequence[Key]) -> None:
        self.future = [tuple(k) for k in future]
        self.uses: defaultdict[Key, list[int]] = defaultdict(list)
        for i, key in enumerate(self.future):
            self.uses[key].append(i)
        self.pos = 0  # index of the next access

    def access(self, key: Key, now: int) -> None:
        if self.pos >= len(self.future) or self.future[self.pos] != key:
            raise PagingError(f"the Belady oracle's trace does not match this run at access {self.pos} "
                              f"(expected {self.future[self.pos] if self.pos < len(self.future) else 'the end'}, "
                              f"got layer {key[0]} expert {key[1]}); record the trace with the same prompt, "
                              f"model and sampling settings")
        self.pos += 1

    def next_use(self, key: Key) -> float:
        uses = self.uses.get(key, ())
        i = bisect.bisect_left(uses, self.pos)
        return uses[i] if i < len(uses) else math.inf

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        return max(candidates, key=self.next_use)


def make_policy(name: str, trace: Sequence[Key] | None = None, **options) -> Policy:
    """A policy by name; "belady" needs `trace` (the demand accesses to come)."""
    name = name.lower()
    if name == "lru":
        return LRU()
    if name == "lfu":
        return LFU()
    if name == "lfru":
        return LFRU(**options)
    if name == "belady":
        if trace is None:
            raise PagingError("the belady policy needs a routing trace (record one with `localmoe trace`)")
        return Belady(trace)
    raise PagingError(f"unknown paging policy {name!r}; choose one of {', '.join(POLICIES)}")
