"""The pager's readers: demanded loads are read before guesses, a guess its layer's routing did not choose is
settled (wasted; never read if no reader took it yet), and the prefetch counts stay consistent across a reset."""

from __future__ import annotations

import threading

import torch

from localmoe.engine.experts import ExpertWeights
from localmoe.paging.disk import ODirectBackend
from localmoe.paging.pager import Pager
from localmoe.paging.policy import LRU


class _Gated(ODirectBackend):
    """Records each read as it starts, and lets it go on only when `release` is called."""

    def __init__(self, store):
        super().__init__(store)
        self.started: list[tuple[int, int]] = []
        self.cond, self.allowed = threading.Condition(), 0

    def read(self, layer, expert, out):
        with self.cond:
            self.started.append((layer, expert))
            self.cond.notify_all()
            self.cond.wait_for(lambda: self.allowed > 0, timeout=30)
            self.allowed -= 1
        return super().read(layer, expert, out)

    def wait_started(self, n: int) -> list[tuple[int, int]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.started) >= n, timeout=30), self.started
            return list(self.started)

    def release(self, n: int = 1) -> None:
        with self.cond:
            self.allowed += n
            self.cond.notify_all()


def _same(store, layer, expert, w) -> bool:
    ref = ExpertWeights.from_parts(store.expert(layer, expert))
    return all(torch.equal(getattr(w, p).packed, getattr(ref, p).packed) for p in ("gate", "up", "down"))


def test_demanded_reads_first_and_unchosen_guesses_never_read(gpt_oss):
    store = gpt_oss.store()
    a, b, c = store.layers()[:3]
    backend = _Gated(store)
    pager = Pager(store, 16, LRU(), backend, io_threads=1)
    try:
        pager.begin_layer(a, [0], [(b, [5, 6, 7])])  # a's expert 0 now, then the guesses for b, best first
        assert backend.wait_started(1) == [(a, 0)]
        assert len(pager._held_back) == 3  # not handed to the readers while a demanded read runs
        pager.begin_layer(c, [1])  # demanded while the guesses wait: read before them
        backend.release()
        assert backend.wait_started(2) == [(a, 0), (c, 1)]
        backend.release()
        pager.hold(c, [1])  # the demanded reads are in: the guesses go to the readers
        assert not pager._held_back
        assert backend.wait_started(3)[2] == (b, 5)  # then the best guess
        pf = pager.stats.prefetch
        assert (pf.issued, pf.pending) == (3, 3)
        pager.begin_layer(b, [6])  # b's routing: 5 (being read) and 7 (queued) were wrong; 7 is dropped unread
        assert (pf.used, pf.wasted, pf.pending) == (0, 2, 1) and (b, 7) not in pager.where
        backend.release(10)
        held = pager.hold(b, [6])
        assert _same(store, b, 6, held[0])
        assert backend.started == [(a, 0), (c, 1), (b, 5), (b, 6)]
        assert (pf.used, pf.wasted, pf.pending, pf.issued) == (1, 2, 0, 3) and pf.precision == 1 / 3
        assert (b, 5) in pager.resident()  # a wrong guess that was read stays as an ordinary cached expert
        assert (b, 5) in pager._evictable
    finally:
        backend.release(100)
        pager.close()


def test_stale_guesses_do_not_stop_the_lookahead(gpt_oss):
    """Guesses the routing did not choose leave the quarter of the slots that unused guesses may take: a later
    layer's guesses are read again (before, they stayed pending forever and the lookahead stopped)."""
    store = gpt_oss.store()
    a, b = store.layers()[:2]
    pager = Pager(store, 8, LRU(), ODirectBackend(store), io_threads=2)  # at most 2 unused guesses
    try:
        assert len(store.experts_in(b)) >= 8
        for step in range(3):
            pager.begin_layer(a, [step], [(b, [2 + 2 * step, 3 + 2 * step])])  # two new guesses each time
            pager.hold(a, [step])
            pager.begin_layer(b, [0])
            pager.hold(b, [0])
        pf = pager.stats.prefetch
        assert pf.issued == 6 and pf.pending == 0 and pf.used == 0 and pf.wasted == pf.issued
    finally:
        pager.close()


def test_precision_stays_within_one_after_a_reset(gpt_oss):
    """Guesses issued before `reset_counts` and used after it count as issued in the new period."""
    store = gpt_oss.store()
    a, b = store.layers()[:2]
    pager = Pager(store, 8, LRU(), ODirectBackend(store), io_threads=2)
    try:
        pager.begin_layer(a, [0], [(b, [3, 4])])
        pager.hold(a, [0])
        pager.stats.reset_counts()
        pf = pager.stats.prefetch
        assert (pf.issued, pf.pending, pf.used) == (2, 2, 0)
        pager.begin_layer(b, [3, 4])
        pager.hold(b, [3, 4])
        assert (pf.used, pf.wasted, pf.pending) == (2, 0, 0) and pf.precision == 1.0
        assert pager.stats.ram.hits == 2 and pf.covered == 2
    finally:
        pager.close()


def test_guess_width_follows_each_ranks_measured_precision(gpt_oss):
    """One token's guesses are read from the best rank down while a rank's precision (settled guesses of that rank
    its layer's routing chose) reaches the bar; every EXPLORE-th call guesses all ranks, to keep measuring."""
    from localmoe.paging.pager import EXPLORE, GUESS_BAR

    store = gpt_oss.store()
    a, b = store.layers()[:2]
    experts = store.experts_in(b)
    pager = Pager(store, 64, LRU(), ODirectBackend(store), io_threads=2)
    try:
        assert pager.guess_width(4) == 4  # nothing measured: the prior (1 in 2) reaches the bar
        for step in range(8):  # rank 0 always right, rank 1 always wrong
            right, wrong = experts[(2 * step) % len(experts)], experts[(2 * step + 1) % len(experts)]
            pager.begin_layer(a, [0], [(b, [right, wrong])], ranked=True)
            pager.hold(a, [0])
            pager.begin_layer(b, [right])
            pager.hold(b, [right])
            for key in list(pager.where):  # a fresh slab for the next step's guesses
                if key[0] == b:
                    pager._evict(pager.where[key])
        assert pager._precision(0) > GUESS_BAR > pager._precision(1)
        widths = [pager.guess_width(4) for _ in range(EXPLORE)]
        assert sorted(widths) == [1] * (EXPLORE - 1) + [4]  # rank 0 only, but all ranks once in EXPLORE calls
    finally:
        pager.close()


def test_guesses_two_layers_ahead_are_measured_apart(gpt_oss):
    """A guess of the MoE layer after next has its own rank precision: right guesses one layer ahead do not make
    wrong ones two layers ahead worth reading (every EXPLORE-th routed layer still guesses every rank of both)."""
    from localmoe.paging.pager import EXPLORE, GUESS_BAR, _rank

    store = gpt_oss.store()
    a, b, c = store.layers()[:3]
    experts = store.experts_in(b)
    pager = Pager(store, 64, LRU(), ODirectBackend(store), io_threads=2)
    try:
        assert pager.guess_width(4, 2) == 4  # nothing measured: the prior reaches the bar
        for step in range(8):  # one layer ahead: rank 0 right, rank 1 wrong; two layers ahead: rank 0 wrong
            right, wrong = experts[(2 * step) % len(experts)], experts[(2 * step + 1) % len(experts)]
            pager.begin_layer(a, [0], [(b, [right, wrong]), (c, [wrong])], ranked=True)
            assert {key for key in pager.where if key[0] in (b, c)} == {(b, right), (b, wrong), (c, wrong)}
            pager.hold(a, [0])
            pager.begin_layer(b, [right])
            pager.hold(b, [right])
            pager.begin_layer(c, [right])
            pager.hold(c, [right])
            for key in list(pager.where):  # a fresh slab for the next step's guesses
                if key[0] in (b, c):
                    pager._evict(pager.where[key])
        assert pager._precision(_rank(0, 1)) > GUESS_BAR > pager._precision(_rank(0, 2))
        assert pager._precision(_rank(1, 1)) < GUESS_BAR
        widths = [(pager.guess_width(4, 1), pager.guess_width(4, 2)) for _ in range(EXPLORE)]
        assert sorted(widths) == [(1, 0)] * (EXPLORE - 1) + [(4, 4)]
    finally:
        pager.close()


def test_a_union_of_guesses_is_cut_to_one_per_reader_where_the_layers_misses_outnumber_the_readers(gpt_oss):
    """Several rows' guesses (not ranked) are all read while the layer's own misses do not outnumber the readers;
    where they do (a decode step of several rows), only the most voted, one per reader, of the nearest layer, and
    only once the layer's own reads are in; one token's ranked guesses always are."""
    store = gpt_oss.store()
    a, b, c = store.layers()[:3]
    pager = Pager(store, 32, LRU(), ODirectBackend(store), io_threads=2)
    calls = []

    def ahead():
        calls.append(1)
        return [(b, [8, 7, 9]), (c, [1])]  # most voted first (hooks._voted)

    try:
        pager.begin_layer(a, [0, 1], [(b, [5, 6])])  # two misses, two readers: the guesses are read
        assert pager.stats.prefetch.issued == 2
        pager.hold(a, [0, 1])
        pager.begin_layer(a, [2, 3, 4], ahead)  # three misses outnumber the readers: the two most voted of b
        assert calls == [1] and pager.stats.prefetch.issued == 4
        assert (b, 8) in pager.where and (b, 7) in pager.where and (b, 9) not in pager.where
        assert (c, 1) not in pager.where and len(pager._held_back) == 2
        pager.hold(a, [2, 3, 4])
        assert not pager._held_back
        pager.begin_layer(a, [5, 6, 7], [(b, [1])], ranked=True)  # one token's ranked guess: read
        assert pager.stats.prefetch.issued == 5 and (b, 1) in pager.where
        pager.hold(a, [5, 6, 7])
    finally:
        pager.close()


def test_a_union_of_guesses_is_kept_where_the_rows_chose_most_of_the_layer(gpt_oss):
    """A step whose rows chose at least GUESS_BAR of a layer's experts (prompt rows) keeps several rows' guesses
    even where its misses outnumber the readers: the next layer's rows will choose most of theirs too. The layer's
    own reads are started before the guesses are computed (their routing does not delay them)."""
    from localmoe.paging.pager import GUESS_BAR

    store = gpt_oss.store()
    a, b = store.layers()[:2]
    experts = len(store.experts_in(a))
    wide = list(range(max(3, int(GUESS_BAR * experts + 0.999))))
    assert len(wide) < experts <= 16
    pager = Pager(store, 40, LRU(), ODirectBackend(store), io_threads=2)
    calls = []

    def ahead():
        calls.append(all((a, e) in pager.where for e in wide))  # this layer's loads already started
        return [(b, [0, 1, 2])]

    try:
        pager.begin_layer(a, wide, ahead)
        assert calls == [True] and pager.stats.prefetch.issued == 3 and (b, 2) in pager.where
        pager.hold(a, wide)
        pager.begin_layer(b, [0, 1, 2, 3], ())  # the guesses were right: 3 used
        pager.hold(b, [0, 1, 2, 3])
        assert pager.stats.prefetch.used == 3 and pager.stats.prefetch.wasted == 0
    finally:
        pager.close()


def test_prompt_rows_guess_the_experts_two_rows_guessed_most_guessed_first():
    """Several rows' union of guesses: the most guessed experts first; where the rows' picks outnumber the layer's
    experts (prompt rows), one row's pick alone is not read."""
    from localmoe.paging.hooks import _voted

    ids = [[3, 1], [1, 2], [5, 1], [2, 0]]  # votes: 1 x3, 2 x2, 3 0 5 once
    assert _voted(ids, experts=16) == [1, 2, 3, 5, 0]  # 8 picks of 16 experts: all, by votes then rank
    assert _voted(ids, experts=6) == [1, 2]  # 8 picks of 6 experts: the ones two rows guessed


def test_guesses_wait_for_the_demanded_reads(gpt_oss):
    """A guess is handed to the readers only once no demanded read is left (the disk's rate is shared: beside the
    layer's demanded reads it would delay them); one requested meanwhile is read at once, as a demanded read, and
    one its layer's routing did not choose is never read."""
    store = gpt_oss.store()
    a, b = store.layers()[:2]
    backend = _Gated(store)
    pager = Pager(store, 16, LRU(), backend, io_threads=2)
    try:
        pager.begin_layer(a, [0, 1], [(b, [5, 6])])
        assert sorted(backend.wait_started(2)) == [(a, 0), (a, 1)]
        assert [r.key for r in pager._held_back] == [(b, 5), (b, 6)]
        pager.begin_layer(b, [5])  # b routed before a's reads are in: 5 is read now, 6 is dropped unread
        assert not pager._held_back and (b, 6) not in pager.where
        backend.release(3)
        held = pager.hold(b, [5])
        assert _same(store, b, 5, held[0])
        assert sorted(backend.started) == [(a, 0), (a, 1), (b, 5)]
        pf = pager.stats.prefetch
        assert (pf.issued, pf.used, pf.wasted, pf.pending) == (2, 1, 1, 0)
        pager.begin_layer(a, [2], [(b, [7])])  # held back, then submitted when a's read is in
        backend.release(2)
        pager.hold(a, [2])
        assert backend.wait_started(5)[4] == (b, 7)
    finally:
        backend.release(100)
        pager.close()
