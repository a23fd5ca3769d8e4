"""DSA indexer scoring + top-k: Triton scores against the reference, the selected sets against
the reference's, and the reference against a per-token loop."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels.topk_select.reference import naive_indexer_scores, naive_topk_select, select_topk

from .conftest import TRITON_DEVICES


def _inputs(B, T, S, H, D, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g)
    w = torch.randn(B, T, H, generator=g) * H ** -0.5
    k = torch.randn(B, S, D, generator=g)
    positions = (S - T + torch.arange(T)).clamp(min=0).expand(B, T).contiguous()  # the last T of S tokens
    return q, w, k, positions


def test_reference_scores_by_loop():
    q, w, k, pos = _inputs(1, 3, 7, 2, 4, seed=0)
    got = naive_indexer_scores(q, w, k, pos)
    for t in range(3):
        for s in range(7):
            want = sum(w[0, t, h] * max(0.0, float(q[0, t, h] @ k[0, s])) for h in range(2)) if s <= pos[0, t] \
                else float("-inf")
            assert got[0, t, s].item() == pytest.approx(float(want), rel=1e-5, abs=1e-6)


def test_select_pads_with_minus_one():
    scores = torch.tensor([[[1.0, float("-inf"), 3.0, float("-inf")]]])
    idx = select_topk(scores, 3)
    assert set(idx[0, 0].tolist()) == {0, 2, -1}
    assert select_topk(scores, 6).shape == (1, 1, 6)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("B,T,S,H,D,top_k", [(1, 1, 1, 4, 32, 4), (2, 3, 63, 8, 32, 16), (1, 2, 500, 16, 64, 64)],
                         ids=lambda *a: None)
def test_triton_matches_reference(B, T, S, H, D, top_k, device, close):
    from localmoe.kernels.topk_select.triton import indexer_scores, topk_select

    q, w, k, pos = _inputs(B, T, S, H, D, seed=S)
    want = naive_indexer_scores(q, w, k, pos)
    got = indexer_scores(q.to(device), w.to(device), k.to(device), pos.to(device))
    close(got, want, 1e-5, "scores")
    idx, ref = topk_select(q.to(device), w.to(device), k.to(device), pos.to(device), top_k).cpu(), \
        naive_topk_select(q, w, k, pos, top_k)
    for b in range(B):  # the same sets (scores are continuous: ties have probability ~0)
        for t in range(T):
            assert set(idx[b, t].tolist()) == set(ref[b, t].tolist())


@pytest.mark.parametrize("B,T,S,H,D,top_k", [(1, 1, 300, 4, 16, 8), (2, 5, 257, 8, 32, 16), (1, 40, 500, 4, 16, 64)],
                         ids=["decode", "odd", "early-queries-see-fewer"])
def test_cpu_blockwise_selects_the_reference_scores(B, T, S, H, D, top_k):
    """Keys in blocks (here 1-2 KiB of head scores: many blocks) with a running top-k choose the reference's
    scores: the same multiset per query (-1 pads where fewer than top_k keys are visible)."""
    from localmoe.kernels.topk_select.cpu import blockwise_topk_select

    q, w, k, pos = _inputs(B, T, S, H, D, seed=S)
    if T > 30:  # query t at position 10 t: the first seven see fewer than top_k keys
        pos = (10 * torch.arange(T)).expand(B, T).contiguous()
    ref_scores = naive_indexer_scores(q, w, k, pos)
    want = naive_topk_select(q, w, k, pos, top_k)
    got = blockwise_topk_select(q, w, k, pos, top_k, max_bytes=4 * B * T * H * top_k)
    assert got.shape == want.shape == (B, T, top_k)
    assert torch.equal((got < 0).sum(-1), (want < 0).sum(-1))
    assert bool((want < 0).any()) == (T > 30)

    def chosen(idx):
        s = ref_scores.gather(-1, idx.clamp(min=0)).masked_fill(idx < 0, float("-inf"))
        return s.sort(-1).values

    torch.testing.assert_close(chosen(got), chosen(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("block_bytes", [None, 64], ids=["one-call", "blocks"])
def test_ties_keep_the_earlier_position_whatever_the_call_shape(block_bytes):
    """Scores tied at relu zero (and at an equal positive score): the lower position wins, in one call or key
    blocks of any size, and for each query of a batch as for that query alone; increasing order, -1 pads."""
    from localmoe.kernels.topk_select.cpu import blockwise_topk_select

    S, D, top_k = 40, 4, 6
    k = torch.zeros(1, S, D)
    k[0, [31, 9, 17], 0] = torch.tensor([2.0, 1.0, 2.0])  # 17 and 31 tie above 0, 9 below them; the rest score 0
    q = torch.zeros(1, 3, 1, D)
    q[..., 0] = 1.0
    pos = torch.tensor([[39, 20, 3]])

    def run(q, pos):
        if block_bytes is None:
            return select_topk(naive_indexer_scores(q, torch.ones(q.shape[:3]), k, pos), top_k)
        return blockwise_topk_select(q, torch.ones(q.shape[:3]), k, pos, top_k, max_bytes=block_bytes)

    got = run(q, pos)[0].tolist()
    assert got == [[0, 1, 2, 9, 17, 31], [0, 1, 2, 3, 9, 17], [0, 1, 2, 3, -1, -1]]
    for t in range(3):  # alone: the same
        assert run(q[:, t:t + 1], pos[:, t:t + 1])[0, 0].tolist() == got[t]
    assert select_topk(torch.tensor([[[1.0, 3.0, 3.0, 3.0]]]), 2)[0, 0].tolist() == [1, 2]
    assert select_topk(torch.zeros(1, 1, 0), 2)[0, 0].tolist() == [-1, -1]  # nothing to choose from
