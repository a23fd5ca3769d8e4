"""The pager's decisions (the loads it starts and the slots it evicts, in order) over a routing trace do not depend on
how its bookkeeping is computed: LFRU's kept pool scores against scoring the whole pool at every call, and a
layer's guesses taking the victims ranked with its misses against asking the policy again. Every read is let finish
between two layers, so the sequence is the same whatever the disk's timing."""

from __future__ import annotations

import random

import numpy as np
import pytest

from localmoe.paging.disk import ODirectBackend
from localmoe.paging.hooks import _ranked, _voted
from localmoe.paging.pager import Pager
from localmoe.paging.policy import LFRU


class _Afresh(LFRU):
    """LFRU scoring its whole pool at every call (no kept scores)."""

    def pool_victims(self, now, n):
        return self._first(np.flatnonzero(self._in_pool), n)


class _Asking(Pager):
    """A pager whose guesses' victims are always asked of the policy again."""

    def _make_room(self, n, more=0, spare=False):
        return super()._make_room(n)


def _quiet(pager: Pager) -> None:
    """Waits until every read started (held-back guesses too) is in."""
    while True:
        with pager.lock:
            pager._reap()
            ids = [r.id for r in pager._reads.values() if r.submitted]
            left = bool(pager._reads)
        if not left:
            return
        for read_id in ids:
            assert pager.readers.wait(read_id, 30.0)


def _events(store, pager_type, policy, seed: int, rows: int) -> list:
    """(event, key, why) of each load started and each slot evicted over a skewed random trace of `rows` rows a step,
    the next layer's guesses from a noisy copy of its routing."""
    layers = store.layers()
    experts = store.experts_in(layers[0])
    slots = max(4, len(layers) * len(experts) // 4)
    pager = pager_type(store, slots, policy, ODirectBackend(store), io_threads=2)
    events = []
    start, evict = pager._start, pager._evict

    def started(slot, key, origin, rank=None):
        events.append(("start", key, origin))
        start(slot, key, origin, rank)

    def evicted(slot):
        events.append(("evict", slot.key, None))
        evict(slot)

    pager._start, pager._evict = started, evicted
    rng = random.Random(seed)
    weights = [1.0 / (e + 1) ** 0.7 for e in range(len(experts))]

    def route() -> list[list[int]]:
        return [list(dict.fromkeys(rng.choices(experts, weights, k=3)))[:2] for _ in range(rows)]

    try:
        routed = route()
        for _ in range(12):
            for i, layer in enumerate(layers):
                following = route()
                chosen = {e for picks in routed for e in picks}
                ahead = []
                if i + 1 < len(layers):
                    noisy = [[e if rng.random() < 0.6 else rng.choice(experts) for e in picks] for picks in following]
                    ahead = [(layers[i + 1], _ranked(noisy) if rows == 1 else _voted(noisy, len(experts)))]
                pager.begin_layer(layer, chosen, ahead, ranked=rows == 1)
                pager.hold(layer, sorted(chosen))
                _quiet(pager)
                routed = following
    finally:
        pager.close()
    return events


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_the_decisions_do_not_depend_on_the_bookkeeping(gpt_oss, rows):
    store = gpt_oss.store()
    for seed in range(2):
        ref = _events(store, _Asking, _Afresh(), seed, rows)
        assert sum(e[0] == "evict" for e in ref) > 20 and any(e[2] == "lookahead" for e in ref)  # it evicts, guesses
        assert _events(store, Pager, LFRU(), seed, rows) == ref
        assert _events(store, _Asking, LFRU(), seed, rows) == ref
        assert _events(store, Pager, _Afresh(), seed, rows) == ref


def test_guess_orders_are_the_tensor_forms():
    """`_ranked` / `_voted` on plain lists order a guess as the torch expressions they replace did."""
    import torch

    rng = random.Random(3)
    for _ in range(200):
        n, k, experts = rng.randint(1, 9), rng.randint(1, 4), rng.randint(4, 24)
        ids = torch.tensor([rng.sample(range(experts), k) for _ in range(n)])
        ranked = list(dict.fromkeys(ids.t().reshape(-1).tolist()))
        votes = torch.bincount(ids.reshape(-1), minlength=max(ranked) + 1).tolist()
        least = 2 if ids.numel() > experts else 1
        voted = sorted((e for e in ranked if votes[e] >= least), key=lambda e: -votes[e])
        assert _ranked(ids.tolist()) == ranked
        assert _voted(ids.tolist(), experts) == voted
