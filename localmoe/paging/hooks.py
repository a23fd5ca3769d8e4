"""Hooks on a built model, applied from outside (the engine is not edited): each MoE block's
router is wrapped so that, after routing, the pager learns the layer's chosen experts
(`Pager.begin_layer`) and, with them, the next MoE layer's experts as its router guesses them
from this layer's input (router lookahead: loaded after the chosen ones), and a `RoutingTrace` can record
(token, layer, experts). The wrapper returns exactly what the router returned, so outputs
do not change. `detach` restores the plain routers.
"""

from __future__ import annotations

import torch


class PagedRouter:
    """Stands in for `MoEBlock.router`: same call, same result, plus the paging hints."""

    def __init__(self, router, layer: int, pager=None, next_router=None, next_layer: int | None = None,
                 trace=None):
        self.router, self.layer, self.pager = router, layer, pager
        self.next_router, self.next_layer, self.trace = next_router, next_layer, trace

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, D] -> (weights [N, k], ids [N, k]), unchanged from the wrapped router."""
        weights, ids = self.router(x)
        if self.trace is not None:
            self.trace.record(self.layer, ids)
        if self.pager is not None:
            self.pager.stats.routed += ids.numel()
            ahead = None
            if self.next_router is not None and self.pager.prefetch_enabled and not self.pager.holds_all(
                    self.next_layer):  # (a layer whose experts all sit in slots needs no guess)
                _, guess = self.next_router(x)  # layer L+1's router on layer L's input: a guess
                ahead = (self.next_layer, sorted(set(guess.reshape(-1).tolist())))
            self.pager.begin_layer(self.layer, set(ids.reshape(-1).tolist()), ahead)  # its loads first
        return weights, ids

    def __getattr__(self, name):  # rule, linear, correction_bias, ... of the wrapped router
        return getattr(self.router, name)

    def nbytes(self) -> int:
        return self.router.nbytes()


def _plain(router):
    while isinstance(router, PagedRouter):
        router = router.router
    return router


def attach(transformer, pager=None, trace=None, lookahead: bool = True, whole: bool = True) -> None:
    """Wrap the routers of `transformer` (an engine Transformer) for `pager` and/or `trace`. With `whole`, a pager
    whose slab holds every expert reads them all now (`Pager.load_all`) and gets no hooks: its layers then run as
    resident ones, routing inside the experts' kernel call."""
    if pager is not None and whole and pager.load_all():
        pager = None
        if trace is None:
            return
    blocks = transformer.moe_blocks()
    routers = [_plain(b.router) for b in blocks]
    for i, block in enumerate(blocks):
        nxt = i + 1 < len(blocks) and lookahead
        block.router = PagedRouter(routers[i], block.layer, pager, routers[i + 1] if nxt else None,
                                   blocks[i + 1].layer if nxt else None, trace)


def detach(transformer) -> None:
    for block in transformer.moe_blocks():
        block.router = _plain(block.router)
