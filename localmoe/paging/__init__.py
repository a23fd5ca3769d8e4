"""Expert residency: where each routed expert lives (disk, host RAM, GPU) and how it moves.

`provider_for_store(store, spec, config)` is what the loader calls for a packed store: an
`ExpertProvider` (engine/experts.py) that serves (layer, expert) requests from the store.
"""

from __future__ import annotations

from localmoe.engine.experts import ExpertWeights


class StoreExperts:
    """Every expert read straight from the store's maps (no budget: the page cache decides)."""

    def __init__(self, store):
        self.store = store

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return ExpertWeights.from_parts(self.store.expert(layer, expert))

    def nbytes(self) -> int:
        return 0  # nothing held beyond the OS page cache


def provider_for_store(store, spec, config):
    """The ExpertProvider the engine config asks for over `store` (a PackedStore)."""
    return StoreExperts(store)
