"""GLM-5-Next's k-pool indexer against a float64 brute force written from the description:
pools from each row's first real token, gated per-channel pooled keys, top pools by score among
those whose last token the query sees, plus the query's incomplete tail pool. Data are positive
(q, k, w > 0), so no score is a relu zero and the top pools are unique (no ties)."""

from __future__ import annotations

import math

import pytest
import torch

from localmoe.engine.layers.kpool_indexer import KPoolIndexer
from localmoe.engine.linear import Linear
from localmoe.engine.step import Step

HIDDEN, HEADS, DI = 12, 2, 4


def indexer(pool: int, top_k: int, tail: bool) -> KPoolIndexer:
    g = torch.Generator().manual_seed(pool * 100 + top_k)
    shapes = {"wq_b.weight": (HEADS * DI, 6), "wk.weight": (DI, HIDDEN), "weights_proj.weight": (HEADS, HIDDEN),
              "index_kpool_compress_gate": (DI, HIDDEN), "index_kpool_compress_ape": (pool, DI)}
    weights = {name: torch.randn(*shape, generator=g) for name, shape in shapes.items()}
    weights |= {"k_norm.weight": torch.ones(DI), "k_norm.bias": torch.zeros(DI)}
    return KPoolIndexer(*(Linear(weights[n], None, "float32") for n in ("wq_b.weight", "wk.weight")),
                        weights["k_norm.weight"], weights["k_norm.bias"],
                        Linear(weights["weights_proj.weight"], None, "float32"), HEADS, DI, 0, top_k,
                        gate=Linear(weights["index_kpool_compress_gate"], None, "float32"),
                        ape=weights["index_kpool_compress_ape"], pool=pool, tail=tail)


def step_for(pads: list[int], start: int, T: int) -> Step:
    """A Step over S = start + T cached positions, row b left-padded by pads[b] (as engine/step.py builds it)."""
    S = start + T
    keys = torch.stack([torch.arange(S) >= p for p in pads])  # [B, S]
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)[None] & keys[:, None, :]
    mask[:, torch.arange(T), torch.arange(start, S)] = True
    return Step(start, torch.zeros(len(pads), T, dtype=torch.long), None, None, mask, keys[:, start:])


def brute_force(idx: KPoolIndexer, q, w, keys, gates, pad: int, position: int) -> set[int]:
    """The token set one real query at cache `position` attends to, in float64 with explicit loops."""
    P, S = idx.pool, keys.shape[0]
    ape = idx.ape.double()
    pools = []
    j = 0
    while pad + (j + 1) * P <= S:  # complete pools from the first real token
        members = list(range(pad + j * P, pad + (j + 1) * P))
        pooled = []
        for d in range(DI):
            e = [math.exp(float(gates[i, d]) + float(ape[n, d])) for n, i in enumerate(members)]
            pooled.append(sum(e[n] * float(keys[i, d]) for n, i in enumerate(members)) / sum(e))
        if members[-1] <= position:
            score = sum(float(w[h]) * max(0.0, sum(float(q[h, d]) * pooled[d] for d in range(DI)))
                        for h in range(HEADS))
            pools.append((score, members))
        j += 1
    pools.sort(key=lambda sm: -sm[0])
    chosen = {i for _, members in pools[:idx.top_k // P] for i in members}
    if idx.tail:
        seen = position - pad + 1
        chosen |= set(range(position + 1 - seen % P, position + 1))
    return chosen


@pytest.mark.parametrize("pool,top_k,tail,pads,start,T", [
    (3, 6, True, [0, 5], 0, 23),     # prefill, one row left-padded
    (3, 6, True, [0, 5], 22, 1),     # decode
    (2, 4, False, [3], 10, 7),       # no tail, a chunk after a cached prefix
    (4, 8, True, [0, 2], 30, 3),     # several queries per call, pools misaligned by the padding
    (1, 5, True, [1], 0, 12),        # pools of one token: DeepSeek's per-token selection
    (2, 64, True, [0], 0, 20),       # index_topk above the context: every visible token
], ids=["prefill", "decode", "no_tail", "chunk", "pool1", "dense"])
def test_selection_equals_float64_brute_force(pool, top_k, tail, pads, start, T):
    idx = indexer(pool, top_k, tail)
    B, S = len(pads), start + T
    g = torch.Generator().manual_seed(S)
    keys, gates = torch.rand(B, S, DI, generator=g) + 0.1, torch.randn(B, S, DI, generator=g)
    q, w = torch.rand(B, T, HEADS, DI, generator=g) + 0.1, torch.rand(B, T, HEADS, generator=g) + 0.1
    step = step_for(pads, start, T)
    got = idx.select(q, w, torch.cat([keys, gates], -1), step)
    assert got.shape == (B, T, idx.width)
    for b, pad in enumerate(pads):
        for t in range(T):
            position = start + t
            row = got[b, t].tolist()
            if position < pad:  # a padding query keeps only itself
                assert [i for i in row if i >= 0] == [position]
                continue
            want = brute_force(idx, q[b, t].double(), w[b, t].double(), keys[b].double(), gates[b].double(), pad,
                               position)
            assert sorted(i for i in row if i >= 0) == sorted(want), (b, t)
            assert len([i for i in row if i >= 0]) == len(want)  # no token twice
    if top_k >= S:
        assert idx.dense_context >= S


def test_dense_context_is_where_nothing_can_be_dropped():
    assert indexer(4, 8, True).dense_context == 11  # 2 pools + a 3-token tail
    assert indexer(4, 8, False).dense_context == 0  # the newest tokens are never all selected
    assert indexer(1, 5, False).dense_context == 5
