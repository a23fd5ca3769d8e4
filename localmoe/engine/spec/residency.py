"""What a draft will read on a paged model: the experts its tokens' routing predicts, which of them are
resident, and prefetching the rest before the verify needs them.

A prompt-lookup draft copies a span of the sequence (`Draft.source`: where the copied tokens stood). Those
tokens were routed when they ran (the prompt's prefill, or an earlier step), so the experts they chose then,
layer by layer, predict what the same tokens choose when the verify runs them again: the hidden states
differ by the context, but a quoted span mostly routes as it did. `RouteBook` (the routers' `trace`, set by
paging.hooks.attach) keeps the latest forward's choices; `Residency` files them by position for one
sequence (through the cache's `hidden_sink`, told the positions each forward wrote) and answers:
- `missing(source, n)`: for each draft prefix 1..n, how many of the experts the drafts predict are not
  resident in the pager (the reads the verify would add: the speculator's cost model, speculator.py);
- `prefetch(source, n)`: ask the pager to load the predicted experts the kept drafts need (its own
  prefetch rules apply: it never evicts the experts in use, and holds a bounded number of guesses).
The pager is duck-typed (localmoe/paging's Pager: `resident()`, `prefetch(layer, experts)`,
`stats.ram.stall_seconds` / `.misses`); the engine does not import the paging layer.
Drafts from a draft model or the MTP layer have no source: their routing in the target is not known
before the verify, which reads the union of its rows' experts once, in parallel (paging.hooks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class RouteBook:
    """The routing of the model's latest forward: layer -> ids [N, k] (the `trace` protocol of paging.hooks)."""

    def __init__(self):
        self.current: dict[int, torch.Tensor] = {}
        self._last: int | None = None

    def record(self, layer: int, ids: torch.Tensor) -> None:
        if self._last is not None and layer <= self._last:  # a new forward pass
            self.current = {}
        self._last = layer
        self.current[layer] = ids.detach().to(torch.int16)

    def rows(self, n: int) -> torch.Tensor | None:
        """The latest forward's choices [n, layers, k] when it ran exactly n rows (one sequence's), else None."""
        if not self.current or any(ids.shape[0] != n for ids in self.current.values()):
            return None
        return torch.stack([self.current[layer] for layer in sorted(self.current)], dim=1)


class Residency:
    """One sequence's routes by position and the pager they are checked against (see the module docstring)."""

    def __init__(self, pager, book: RouteBook, prefetch: bool = True):
        self.pager, self.book, self.prefetching = pager, book, prefetch
        self.layers: list[int] = []  # the MoE layers, in the order of the routes' second axis
        self.routes: torch.Tensor | None = None  # [positions, layers, k] int16, -1: not seen
        self.cache = None

    def watch(self, cache) -> None:
        cache.hidden_sink = self.sink
        self.cache = cache

    def unwatch(self) -> None:
        if self.cache is not None and self.cache.hidden_sink == self.sink:
            self.cache.hidden_sink = None

    def sink(self, start: int, tokens: torch.Tensor, hidden: torch.Tensor, settled: bool) -> None:
        rows = self.book.rows(len(tokens))
        if rows is None:
            return
        if self.routes is None:
            self.layers = sorted(self.book.current)
            self.routes = torch.full((self.cache.max_len, *rows.shape[1:]), -1, dtype=torch.int16)
        self.routes[start:start + len(tokens)] = rows

    def predicted(self, source: int, n: int) -> list[set[tuple[int, int]]]:
        """The (layer, expert) keys each of the n drafts copied from `source` on is predicted to read."""
        if self.routes is None or source < 0:
            return [set() for _ in range(n)]
        out = []
        for row in self.routes[source:source + n].tolist():
            out.append({(self.layers[i], e) for i, ids in enumerate(row) for e in ids if e >= 0})
        return out + [set() for _ in range(n - len(out))]

    def missing(self, keys: Sequence[set[tuple[int, int]]]) -> list[int]:
        """For each prefix of the drafts' predicted keys: how many (distinct) are not resident."""
        resident = self.pager.resident()
        union, out = set(), []
        for k in keys:
            union |= k
            out.append(len(union - resident))
        return out

    def prefetch(self, keys: Sequence[set[tuple[int, int]]]) -> int:
        """Start loading the predicted experts not resident, layer by layer; returns loads started."""
        if not self.prefetching:
            return 0
        by_layer: dict[int, set[int]] = {}
        for k in keys:
            for layer, e in k:
                by_layer.setdefault(layer, set()).add(e)
        return sum(self.pager.prefetch(layer, sorted(es)) for layer, es in sorted(by_layer.items()))

    def counters(self) -> tuple[float, int]:
        """(seconds the compute thread stalled on expert reads, expert misses) so far."""
        ram = self.pager.stats.ram
        return ram.stall_seconds, ram.misses
