"""Hooks on a built model, applied from outside (the engine is not edited): each MoE block's
router is wrapped so that, after routing, the pager learns the layer's chosen experts
(`Pager.begin_layer`) and, with them, the next MoE layer's experts as its router guesses them
from this layer's input (router lookahead: loaded after the chosen ones; for one token only the ranks worth
reading, `Pager.guess_width`), and a `RoutingTrace` can record
(token, layer, experts). The wrapper returns exactly what the router returned, so outputs
do not change. `detach` restores the plain routers.
"""

from __future__ import annotations

import time

import torch

DEPTH = 1  # MoE layers guessed ahead of each routed one


def _ranked(rows: list[list[int]]) -> list[int]:
    """The distinct experts of a guess (rows of expert ids, each best first), best first: every row's first pick,
    then their seconds, ... (the pager reads guesses in this order while no demanded read waits). Plain lists: a
    guess is a few ids, and torch's per-call cost on a [N, k] tensor is what a paged layer's hints spent most on."""
    return list(dict.fromkeys(e for picks in zip(*rows) for e in picks))


def _voted(rows: list[list[int]], experts: int) -> list[int]:
    """Several rows' guess (rows of expert ids): the distinct experts, the most guessed first (ties as `_ranked`).
    Where the rows guess more picks than the layer has experts (prompt rows), only the experts two or more rows
    guessed: one row's pick among so many is the weakest guess, and a wrong one costs a whole read."""
    votes: dict[int, int] = {}
    for picks in rows:
        for e in picks:
            votes[e] = votes.get(e, 0) + 1
    least = 2 if sum(map(len, rows)) > experts else 1
    return sorted((e for e in _ranked(rows) if votes[e] >= least), key=lambda e: -votes[e])


class PagedRouter:
    """Stands in for `MoEBlock.router`: same call, same result, plus the paging hints. `ahead`: (router, layer) of
    the later MoE layers to guess from this layer's input, nearest first."""

    def __init__(self, router, layer: int, pager=None, ahead=(), trace=None):
        self.router, self.layer, self.pager, self.ahead, self.trace = router, layer, pager, list(ahead), trace

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], ids [N, k]), unchanged from the wrapped router."""
        weights, ids = self.router(x)
        if self.trace is not None:
            self.trace.record(self.layer, ids)
        if self.pager is not None:
            started = time.perf_counter()
            self.pager.stats.routed += ids.numel()
            one = x.shape[0] == 1
            # one token: the ranks worth reading at each distance (their measured precision; taken before
            # begin_layer holds the pager's lock); several rows: all (the union is wide)
            widths = [self.pager.guess_width(ids.shape[1], d) if one else ids.shape[1]
                      for d in range(1, len(self.ahead) + 1)] if self.pager.prefetch_enabled else []

            def guesses() -> list[tuple[int, list[int]]]:
                """[(later layer, its guessed experts)], one entry per later layer, nearest first (its distance is
                its position)."""
                out = []
                for width, (router, layer) in zip(widths, self.ahead):
                    guess = []
                    if width and not self.pager.holds_all(layer):  # (all its experts in slots: no guess)
                        _, ids_ahead = router(x)  # a later layer's router on this layer's input: a guess
                        rows = ids_ahead.tolist()
                        guess = _ranked([picks[:width] for picks in rows]) if one else \
                            _voted(rows, self.pager.experts_in(layer))
                    out.append((layer, guess))
                return out

            # the guesses are routed inside begin_layer, after this layer's reads are submitted (and several rows'
            # only where it keeps them: a step carrying prompt rows, not a decode step's few rows): K3 `large` at 25%,
            # one token, wall 0.82x against routing them first (session 12)
            chosen = set(ids.reshape(-1).tolist())
            self.pager.hinted(time.perf_counter() - started)  # the hints' own work before begin_layer
            self.pager.begin_layer(self.layer, chosen, guesses, ranked=one)  # its loads first
        return weights, ids

    def __getattr__(self, name):  # rule, linear, correction_bias, ... of the wrapped router
        return getattr(self.router, name)

    def nbytes(self) -> int:
        return self.router.nbytes()


def _plain(router):
    while isinstance(router, PagedRouter):
        router = router.router
    return router


def attach(transformer, pager=None, trace=None, lookahead: bool = True, whole: bool = True,
           depth: int = DEPTH) -> None:
    """Wrap the routers of `transformer` (an engine Transformer) for `pager` and/or `trace`; with `lookahead`, each
    guesses the (up to) `depth` MoE layers after it in the same pass. With `whole`, a pager
    whose slab holds every expert reads them all now (`Pager.load_all`) and gets no hooks: its layers then run as
    resident ones, routing inside the experts' kernel call."""
    if pager is not None and whole and pager.load_all():
        pager = None
        if trace is None:
            return
    blocks = transformer.moe_blocks()
    routers = [_plain(b.router) for b in blocks]
    for i, block in enumerate(blocks):
        later = range(i + 1, min(i + 1 + depth, len(blocks))) if lookahead else ()
        block.router = PagedRouter(routers[i], block.layer, pager, [(routers[j], blocks[j].layer) for j in later],
                                   trace)


def detach(transformer) -> None:
    for block in transformer.moe_blocks():
        block.router = _plain(block.router)
