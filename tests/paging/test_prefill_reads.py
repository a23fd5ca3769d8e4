"""Paged prefill reads each expert a chunk routes to once: one request per (layer, expert) per chunk,
however many of the chunk's tokens chose it, and no read beyond those (prefetch off)."""

from __future__ import annotations

from collections import Counter

import torch

from localmoe.engine.layers import moe
from localmoe.paging import PagingConfig, attach, make_pager


def test_paged_prefill_reads_each_routed_expert_once_per_chunk(kimi_k3, monkeypatch):
    store = kimi_k3.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    pager = make_pager(store, PagingConfig(ram_budget=4 * slot, prefetch=False))  # far fewer slots than experts
    kimi_k3.model.use_experts(pager)
    attach(kimi_k3.model, pager)
    routed: Counter = Counter()  # (layer, expert) -> tokens of the chunk that chose it
    requests: Counter = Counter()  # (layer, expert) -> pager requests
    dispatch, get = moe.dispatch, pager.get

    def record_routes(x, weights, ids, provider, layer, *rest):
        routed.update((layer, int(e)) for e in ids.reshape(-1))
        return dispatch(x, weights, ids, provider, layer, *rest)

    def record_get(layer, expert):
        requests[(layer, expert)] += 1
        return get(layer, expert)

    monkeypatch.setattr(moe, "dispatch", record_routes)
    monkeypatch.setattr(pager, "get", record_get)
    prompt = torch.randint(0, kimi_k3.model.spec.vocab_size, (1, 96), generator=torch.Generator().manual_seed(3))
    cache = kimi_k3.model.new_cache(1, 96)
    try:
        for start in (0, 48):
            routed.clear(), requests.clear(), pager.stats.reset_counts()
            kimi_k3.model.forward(prompt[:, start:start + 48], cache)
            ram = pager.stats.ram
            assert max(routed.values()) > 1  # experts chosen by several tokens of the chunk
            assert requests == Counter(dict.fromkeys(routed, 1))  # each routed expert requested once
            assert ram.hits + ram.misses == len(routed) and ram.loads == ram.misses > 4
            assert ram.bytes_read == ram.loads * pager.slab.slot_bytes
    finally:
        pager.close()
