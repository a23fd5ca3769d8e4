"""Cache policies: which resident expert to evict. Keys are (layer, expert) pairs.

A policy sees every demand access (`access(key, now)`, `now` in decode steps, i.e.
tokens), every insertion and eviction, and picks a victim from the candidates the pager
allows (`victim`). The pager owns the slots; a policy only ranks keys.

- LRU: least recently used.
- LFU: fewest accesses ever (counts survive eviction, so a popular expert that was pushed
  out comes back ranked high); ties broken by recency.
- LFRU: frequency + recency as one estimate: the expert least likely to be used in its
  layer's next pass goes, from per-expert reuse and fresh-use rates (aged, shrunk towards
  the layer's mean or a calibration profile).
- Belady: the offline optimum (MIN) over a recorded access sequence: evict the key used
  furthest in the future. For measurement; the run must follow the trace it was given.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, defaultdict
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

from localmoe.config import PAGING_POLICIES
from localmoe.paging.errors import PagingError

Key = tuple[int, int]  # (layer, expert)
SCALAR_ROWS = 12  # LFRU scores this many stale pool rows or fewer one by one, more as the whole pool with numpy:
# in place (between the kernels' calls) `next_use` costs ~6 us a row and a numpy scoring ~150 us a call
POLICIES = PAGING_POLICIES  # the names, declared with PagingConfig


class Policy:
    """A policy also keeps the pager's eviction pool (`pool`: the keys its routing hints may evict, in the order
    they joined, kept as slots change state) so that `pool_victims` needs no candidate list per call."""

    name = "base"

    def __init__(self) -> None:
        self.pool: dict[Key, None] = {}

    def join_pool(self, key: Key) -> None:
        self.pool[key] = None

    def leave_pool(self, key: Key) -> None:
        self.pool.pop(key, None)

    def pool_victims(self, now: int, n: int) -> list[Key]:
        """`victims(pool, now, n)`."""
        return self.victims(list(self.pool), now, n)

    def access(self, key: Key, now: int) -> None:
        """A demand access to `key` at step `now` (hit or miss)."""

    def insert(self, key: Key, now: int) -> None:
        """`key` became resident (a demand load or a prefetch)."""

    def evict(self, key: Key) -> None:
        """`key` left the cache."""

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        raise NotImplementedError

    def victims(self, candidates: Iterable[Key], now: int, n: int) -> list[Key]:
        """The `n` (or all, if fewer) candidates `victim` would pick one after another, each taken out of the
        candidates before the next pick (evicting changes no policy's scores)."""
        left, out = list(candidates), []
        while left and len(out) < n:
            out.append(self.victim(left, now))
            left.remove(out[-1])
        return out


class LRU(Policy):
    name = "lru"

    def __init__(self) -> None:
        super().__init__()
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
        return self.victims(candidates, now, 1)[0]

    def victims(self, candidates: Iterable[Key], now: int, n: int) -> list[Key]:
        allowed, out = set(candidates), []
        for key in self.order:
            if len(out) == n:
                return out
            if key in allowed:
                out.append(key)
                allowed.discard(key)
        return out + list(allowed)[:n - len(out)]


class LFU(Policy):
    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
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
    """Frequency + recency as one number: each expert is a two-state chain over its layer's
    passes (used / not used in a pass), and the victim is the expert least likely to be
    used in its layer's next pass (the myopic rule that is optimal when routing has no
    memory beyond one token). Per expert, counted as it is accessed:

    - `enter`: P(used | not used in the latest pass) = fresh uses / passes without it:
      the popularity that an LFU count estimates, without the reuse runs that inflate it;
      shrunk towards the layer's mean (`prior` passes' worth of weight) or a calibration
      profile's rate (`popularity`: key -> uses per token, worth `popularity_tokens` passes);
    - `stay`: P(used | used in the layer's latest pass) = re-uses / uses, shrunk
      (`reuse_prior` passes) towards the expert's own `enter` plus its layer's `lift`: what
      a use adds for the next pass (the next-token reuse: ~30% on real models, ~0 on
      random-weight routers), measured as the layer's stays minus the stays that `enter`
      predicted, per use. Shrinking to the layer's mean stay instead (which popular experts
      dominate) let a rarely used expert that was just used outrank popular ones.

    Counts decay by half every `half_life` passes (aging: old popularity fades as the topic
    drifts). `access` is O(1); `victim` scores each candidate, O(candidates) like the pager's
    scan. The per-layer terms of the scores are kept between calls and recomputed only for the layers
    accessed since (all after a rebase), and the eviction pool is a mask over the rows (`pool_victims`)."""

    name = "lfru"

    def __init__(self, half_life: float = 1024.0, prior: float = 4.0, reuse_prior: float = 32.0,
                 popularity: Mapping[Key, float] | None = None, popularity_tokens: float = 0.0) -> None:
        if half_life <= 0 or prior <= 0 or reuse_prior <= 0 or popularity_tokens < 0:
            raise PagingError(f"LFRU needs half_life, prior, reuse_prior > 0 and popularity_tokens >= 0, not "
                              f"{half_life}, {prior}, {reuse_prior}, {popularity_tokens}")
        super().__init__()
        self.half_life, self.prior, self.reuse_prior = half_life, prior, reuse_prior
        self.popularity = dict(popularity or {})
        self.popularity_tokens = popularity_tokens if self.popularity else 0.0
        self.base = 0  # counts are weighted 2^((step - base) / half_life); `_rebase` moves `base`
        self.uses: dict[Key, float] = {}
        self.stays: dict[Key, float] = {}  # uses that follow a use in the layer's previous pass
        self.last: dict[Key, int] = {}
        self.passes: dict[int, float] = {}  # layer -> weighted passes
        self.pass_now: dict[int, int] = {}  # layer -> step of its latest pass
        self.pass_before: dict[int, int | None] = {}  # layer -> step of the pass before that
        self.layer_uses: dict[int, float] = {}
        self.layer_stays: dict[int, float] = {}
        self.layer_expect: dict[int, float] = {}  # stays predicted by `enter` alone: its estimate summed over uses
        self.layer_seen: dict[int, int] = {}  # distinct experts seen
        self.layer: int | None = None  # layer of the latest access (its pass may be in progress)
        self.index: dict[Key, int] = {}  # key -> row of the arrays below, which mirror the dicts above
        self._uses, self._stays = np.zeros(0), np.zeros(0)
        self._last = self._layer = self._expert = np.zeros(0, np.int64)
        self._pop = np.zeros(0)
        self._in_pool = np.zeros(0, bool)  # rows in the eviction pool
        # per layer: passes, sw, swm, lift, rs, stay_rate, pass_now, pass_before (see `_scores`); `_fresh`: the
        # layers whose terms are up to date (an access makes its layer's stale, a rebase all)
        self._terms = np.zeros((6, 0))
        self._passes_at = np.zeros((2, 0), np.int64)
        self._fresh: set[int] = set()
        # `pool_victims` keeps each pool row's score (`_score`) between calls: `_scored` are the layers whose pool
        # rows' scores are up to date (an access makes its layer's stale, and the layer it moves off, whose pass is
        # then no longer in progress; a row joining the pool its layer's; a rebase all); `_pool_rows`: layer ->
        # {row: key} of its rows in the pool
        self._score = np.zeros(0)
        self._scored: set[int] = set()
        self._pool_rows: dict[int, dict[int, Key]] = {}

    def _row(self, key: Key) -> int:
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(self.index)
            if i >= len(self._uses):  # grow by doubling
                n = max(64, 2 * i)
                self._uses, self._stays, self._pop, self._score = (
                    np.resize(a, n) for a in (self._uses, self._stays, self._pop, self._score))
                self._last, self._layer, self._expert = (np.resize(a, n) for a in (self._last, self._layer, self._expert))
                self._in_pool = np.concatenate([self._in_pool, np.zeros(n - len(self._in_pool), bool)])
            self._uses[i] = self._stays[i] = 0.0
            self._last[i], self._layer[i], self._expert[i] = -1, key[0], key[1]
            self._pop[i] = min(self.popularity.get(key, 0.0), 0.999)
        return i

    def _weight(self, now: int) -> float:
        if now - self.base > 256 * self.half_life:
            self._rebase(now)
        return 2.0 ** ((now - self.base) / self.half_life)

    def _rebase(self, now: int) -> None:
        """Refer every weight to `now` (amortised O(1): once per 256 half-lives)."""
        f = 2.0 ** (-(now - self.base) / self.half_life)
        for table in (self.uses, self.stays, self.passes, self.layer_uses, self.layer_stays,
                      self.layer_expect):
            for k in table:
                table[k] *= f
        self._uses *= f
        self._stays *= f
        self.base = now
        self._fresh.clear()
        self._scored.clear()

    def access(self, key: Key, now: int) -> None:
        layer = key[0]
        if layer != self.layer:  # the layer it moves off no longer looks back a pass (`recent`)
            self._scored.discard(self.layer)
        self.layer = layer
        self._fresh.discard(layer)
        self._scored.discard(layer)
        w = self._weight(now)
        if self.pass_now.get(layer) != now:  # the layer's next pass begins
            self.pass_before[layer] = self.pass_now.get(layer)
            self.pass_now[layer] = now
            self.passes[layer] = self.passes.get(layer, 0.0) + w
        prev = self.last.get(key)
        if prev == now:
            return
        expected = w * self.enter(key)  # what this use would predict for the next pass without reuse
        if prev is None:
            self.layer_seen[layer] = self.layer_seen.get(layer, 0) + 1
        self.last[key] = now
        self.uses[key] = self.uses.get(key, 0.0) + w
        i = self._row(key)
        self._last[i], self._uses[i] = now, self.uses[key]
        self.layer_uses[layer] = self.layer_uses.get(layer, 0.0) + w
        self.layer_expect[layer] = self.layer_expect.get(layer, 0.0) + expected
        if prev is not None and prev == self.pass_before.get(layer):
            self.stays[key] = self.stays.get(key, 0.0) + w
            self._stays[i] = self.stays[key]
            self.layer_stays[layer] = self.layer_stays.get(layer, 0.0) + w

    def recent(self, key: Key) -> bool:
        """Used in its layer's latest pass, or in the one before while that layer's pass is in progress."""
        last, layer = self.last.get(key), key[0]
        return last is not None and (last == self.pass_now.get(layer)
                                     or (layer == self.layer and last == self.pass_before.get(layer)))

    def _layer_weight(self, layer: int) -> float:
        return 2.0 ** ((self.pass_now.get(layer, self.base) - self.base) / self.half_life)

    def enter(self, key: Key) -> float:
        """Estimated P(`key` is used in its layer's next pass | not used in its latest pass)."""
        layer = key[0]
        uses, stays = self.uses.get(key, 0.0), self.stays.get(key, 0.0)
        layer_uses, passes, w = self.layer_uses.get(layer, 0.0), self.passes.get(layer, 0.0), self._layer_weight(layer)
        if self.popularity_tokens:  # profile: uses per token -> P(enter) = u (1 - stay) / (1 - u)
            stay_rate = self.layer_stays.get(layer, 0.0) / layer_uses if layer_uses else 0.0
            u = min(self.popularity.get(key, 0.0), 0.999)
            mean, strength = min(1.0, u * (1.0 - stay_rate) / (1.0 - u)), self.popularity_tokens
        else:
            idle = self.layer_seen.get(layer, 1) * passes - layer_uses
            mean = (layer_uses - self.layer_stays.get(layer, 0.0)) / idle if idle > 0 else 0.0
            strength = self.prior
        return (uses - stays + strength * w * mean) / (max(passes - uses, 0.0) + strength * w)

    def lift(self, layer: int) -> float:
        """What a use adds to P(used in the layer's next pass) over `enter`: the layer's reuse."""
        layer_uses = self.layer_uses.get(layer, 0.0)
        if not layer_uses:
            return 0.0
        return max(0.0, (self.layer_stays.get(layer, 0.0) - self.layer_expect.get(layer, 0.0)) / layer_uses)

    def next_use(self, key: Key) -> float:
        """Estimated P(`key` is used in its layer's next pass)."""
        enter = self.enter(key)
        if not self.recent(key):
            return enter
        strength = self.reuse_prior * self._layer_weight(key[0])
        mean = min(1.0, enter + self.lift(key[0]))
        return (self.stays.get(key, 0.0) + strength * mean) / (self.uses.get(key, 0.0) + strength)

    def naive_victim(self, candidates: Iterable[Key], now: int) -> Key:
        """`victim` scored one candidate at a time in Python (the reference it must agree with)."""
        return min(candidates, key=lambda k: (self.next_use(k), self.last.get(k, -1), k))  # total order: any scan order agrees

    def _layer_terms(self, present: list[int]) -> None:
        """Bring the per-layer terms of `present` layers up to date (those accessed since they were computed)."""
        n = present[-1] + 1
        if self._terms.shape[1] < n:
            grow = max(n, 2 * self._terms.shape[1])
            self._terms = np.concatenate([self._terms, np.zeros((6, grow - self._terms.shape[1]))], axis=1)
            self._passes_at = np.concatenate([self._passes_at, np.zeros((2, grow - self._passes_at.shape[1]),
                                                                        np.int64)], axis=1)
        passes, sw, swm, lift, rs, stay_rate = self._terms
        pass_now, pass_before = self._passes_at
        never = np.iinfo(np.int64).min
        for layer in present:
            if layer in self._fresh:
                continue
            self._fresh.add(layer)
            layer_uses, passes[layer], w = (self.layer_uses.get(layer, 0.0), self.passes.get(layer, 0.0),
                                            self._layer_weight(layer))
            if self.popularity_tokens:
                stay_rate[layer] = self.layer_stays.get(layer, 0.0) / layer_uses if layer_uses else 0.0
                sw[layer], swm[layer] = self.popularity_tokens * w, 0.0
            else:
                idle = self.layer_seen.get(layer, 1) * passes[layer] - layer_uses
                mean = (layer_uses - self.layer_stays.get(layer, 0.0)) / idle if idle > 0 else 0.0
                sw[layer], stay_rate[layer] = self.prior * w, 0.0
                swm[layer] = sw[layer] * mean
            lift[layer], rs[layer] = self.lift(layer), self.reuse_prior * w
            now, before = self.pass_now.get(layer), self.pass_before.get(layer)
            pass_now[layer] = never if now is None else now
            pass_before[layer] = never if before is None else before

    def _scores(self, rows: np.ndarray) -> np.ndarray:
        """`next_use` of each row, operation for operation (so bit for bit) as the scalar code: the
        per-layer terms are computed in Python once per layer (`_layer_terms`), then gathered per row."""
        uses, stays, last, layers = self._uses[rows], self._stays[rows], self._last[rows], self._layer[rows]
        present = np.flatnonzero(np.bincount(layers)).tolist()
        self._layer_terms(present)
        passes, sw, swm, lift, rs, stay_rate = self._terms
        pass_now = self._passes_at[0]
        pass_before = np.full(len(pass_now), np.iinfo(np.int64).min)  # only the layer in progress looks back
        if self.layer is not None and self.layer < len(pass_before):
            pass_before[self.layer] = self._passes_at[1, self.layer]
        sw_r = sw[layers]
        if self.popularity_tokens:
            p = self._pop[rows]
            prior = sw_r * np.minimum(1.0, p * (1.0 - stay_rate[layers]) / (1.0 - p))
        else:
            prior = swm[layers]
        enter = (uses - stays + prior) / (np.maximum(passes[layers] - uses, 0.0) + sw_r)
        recent = ((last == pass_now[layers]) | (last == pass_before[layers])) & (last >= 0)
        rs_r = rs[layers]
        reuse = (stays + rs_r * np.minimum(1.0, enter + lift[layers])) / (uses + rs_r)
        return np.where(recent, reuse, enter)

    def _candidate_rows(self, candidates: Iterable[Key]) -> np.ndarray:
        cands = list(candidates)
        try:
            return np.fromiter(map(self.index.__getitem__, cands), np.intp, len(cands))
        except KeyError:  # never accessed (e.g. only prefetched): give it a row of zeros
            return np.fromiter(map(self._row, cands), np.intp, len(cands))

    def victim(self, candidates: Iterable[Key], now: int) -> Key:
        rows = self._candidate_rows(candidates)
        score = self._scores(rows)
        tied = rows[score == score.min()]  # ties: least recent, then the lowest key, as `naive_victim`
        tied = tied[self._last[tied] == self._last[tied].min()]
        layer = self._layer[tied]
        tied = tied[layer == layer.min()]
        i = tied[np.argmin(self._expert[tied])]
        return (int(self._layer[i]), int(self._expert[i]))

    def victims(self, candidates: Iterable[Key], now: int, n: int) -> list[Key]:
        """`Policy.victims` in one scoring pass: the `n` first in `victim`'s order (score, last use, key)."""
        return self._first(self._candidate_rows(candidates), n)

    def join_pool(self, key: Key) -> None:
        super().join_pool(key)
        i = self._row(key)  # (may grow the arrays: before `_in_pool` is looked up)
        self._in_pool[i] = True
        self._pool_rows.setdefault(key[0], {})[i] = key
        self._scored.discard(key[0])

    def leave_pool(self, key: Key) -> None:
        super().leave_pool(key)
        i = self.index.get(key)
        if i is not None:
            self._in_pool[i] = False
            self._pool_rows.get(key[0], {}).pop(i, None)

    def pool_victims(self, now: int, n: int) -> list[Key]:
        """`_first` over the pool, from the kept scores: only the pool rows of layers accessed (or joined) since
        are scored again (element by element the same arithmetic: the same bits)."""
        if n <= 0:
            return []
        stale = self._pool_rows.keys() - self._scored
        rows = np.flatnonzero(self._in_pool)
        if sum(len(self._pool_rows[layer]) for layer in stale) <= SCALAR_ROWS:
            for layer in stale:  # a few: `next_use` one by one (the same arithmetic, without numpy's cost per call)
                for i, key in self._pool_rows[layer].items():
                    self._score[i] = self.next_use(key)
        else:  # many: the whole pool at once (numpy's cost is per call)
            self._score[rows] = self._scores(rows)
            stale = self._pool_rows.keys()
        self._scored.update(stale)
        return self._first(rows, n, self._score[rows])

    def _first(self, rows: np.ndarray, n: int, score: np.ndarray | None = None) -> list[Key]:
        """The `n` first of `rows` (scored `score`, else scored now) in `victim`'s order: only the rows scoring at
        most the n-th lowest score are sorted (the others come after them)."""
        if n <= 0 or not len(rows):
            return []
        if score is None:
            score = self._scores(rows)
        if n < len(rows):
            keep = score <= np.partition(score, n - 1)[n - 1]
            rows, score = rows[keep], score[keep]
        rows = rows[np.lexsort((self._expert[rows], self._layer[rows], self._last[rows], score))[:n]]
        return list(zip(self._layer[rows].tolist(), self._expert[rows].tolist()))


def popularity(counts: Iterable[tuple[int, int, int]], tokens: int) -> dict[Key, float]:
    """A calibration profile's (layer, expert, count) ranking over `tokens` tokens -> uses per token."""
    if tokens <= 0:
        raise PagingError("a calibration profile needs at least one token")
    return {(int(layer), int(e)): int(c) / tokens for layer, e, c in counts}


class Belady(Policy):
    """MIN over `future`, the exact sequence of demand accesses the run will make."""

    name = "belady"

    def __init__(self, future: Sequence[Key]) -> None:
        super().__init__()
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
