"""DSA pieces: the indexer's top-k against a brute-force float64 top-k (and its tie rule), the
gathered decode attention against the masked one on the same selection, the fp8 index cache."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels.topk_select import topk_select

from localmoe.config import EngineConfig
from localmoe.engine.layers.index_cache import IndexKeyCache
from localmoe.engine.step import Step
from localmoe.load import load_model
from localmoe.testing import write_checkpoint


def brute_force(q, w, k, positions, top_k):
    """float64 scores with explicit loops; per query the sorted set of the top_k visible tokens."""
    B, T, H, _ = q.shape
    S = k.shape[1]
    sets = []
    for b in range(B):
        for t in range(T):
            scores = [sum(float(w[b, t, h]) * max(0.0, float(q[b, t, h].double() @ k[b, s].double()))
                          for h in range(H)) for s in range(S) if s <= positions[b, t]]
            order = sorted(range(len(scores)), key=lambda s: -scores[s])
            sets.append(sorted(order[:top_k]))
    return sets


@pytest.mark.parametrize("shape", [(1, 1, 2, 8, 5, 3), (2, 7, 4, 16, 33, 8), (1, 5, 3, 8, 64, 64)],
                         ids=["decode", "prefill", "topk_ge_context"])
def test_topk_equals_brute_force_float64(shape):
    B, T, H, D, S, top_k = shape
    g = torch.Generator().manual_seed(S)
    q, w, k = torch.randn(B, T, H, D, generator=g), torch.rand(B, T, H, generator=g), torch.randn(B, S, D, generator=g)
    positions = torch.arange(S - T, S).expand(B, T)
    got = topk_select(q, w, k, positions, top_k)
    assert got.shape == (B, T, top_k)
    expected = brute_force(q, w, k, positions, top_k)
    rows = got.reshape(B * T, top_k)
    for row, want in zip(rows, expected):
        assert sorted(i for i in row.tolist() if i >= 0) == want
        assert (row < 0).sum() == top_k - len(want)  # -1 pads where fewer tokens are visible


def test_ties_keep_every_better_token_then_the_earliest_tied():
    """relu zeros tie: all positive-scoring tokens are kept, the rest of the k are the earliest tied zeros."""
    D = 4
    k = torch.zeros(1, 10, D)
    k[0, [2, 5, 7], 0] = torch.tensor([1.0, 3.0, 2.0])  # three tokens score > 0, seven score exactly 0
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    got = topk_select(q, torch.ones(1, 1, 1), k, torch.tensor([[9]]), 5)[0, 0].tolist()
    assert got == [0, 1, 2, 5, 7]


@pytest.fixture(scope="module")
def dsa_layer(tmp_path_factory):
    path = write_checkpoint("deepseek_v32", tmp_path_factory.mktemp("dsv32"), "tiny", seed=0)
    return load_model(path, EngineConfig(dtype="float32", threads=1), progress=False).model.layers[1][1]


def _random_selection(config, seed: int, B: int, T: int, S: int, k: int, pads: int):
    """Random queries [B, H, T, *], latent rows [B, S, row_dim] and k distinct selected keys per query [B, T, k],
    the first query's last `pads` entries -1 (pads)."""
    g = torch.Generator().manual_seed(seed)
    q_nope = torch.randn(B, config.num_heads, T, config.qk_nope_head_dim, generator=g)
    q_rope = torch.randn(B, config.num_heads, T, config.qk_rope_head_dim, generator=g)
    rows = torch.randn(B, S, config.row_dim, generator=g)
    selected = torch.stack([torch.randperm(S, generator=g)[:k] for _ in range(B * T)]).view(B, T, k)
    selected[0, 0, -pads:] = -1
    return q_nope, q_rope, rows, selected


def _whole_selection_mask(selected: torch.Tensor, S: int) -> torch.Tensor:
    """[B, T, k] selected keys (-1 pads) -> the [B, T, S] bool mask of them, built at once."""
    B, T, _ = selected.shape
    mask = torch.zeros(B, T, S + 1, dtype=torch.bool).scatter_(-1, torch.where(selected < 0, S, selected), True)
    return mask[..., :S]


def test_gathered_attention_equals_masked_attention_on_the_same_selection(dsa_layer):
    layer = dsa_layer
    B, T, S, k = 2, 3, 40, 6
    q_nope, q_rope, rows, selected = _random_selection(layer.config, 3, B, T, S, k, pads=2)
    step = Step(S - T, torch.arange(S - T, S)[None], None, None, None)
    gathered = layer.attend_gathered(q_nope, q_rope, rows, selected, step)
    masked = layer.attend_absorbed(q_nope, q_rope, rows, _whole_selection_mask(selected, S))
    torch.testing.assert_close(gathered, masked, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(masked, layer.attend_absorbed(q_nope, q_rope, rows, None))  # selection matters


def test_fp8_index_cache_has_one_scale_per_block_of_128():
    cache = IndexKeyCache(1, 64, 256, "fp8")
    keys = torch.randn(1, 40, 256)
    keys[..., 128:] *= 1000  # the second block alone is large: a shared scale would flatten the first
    out = cache.update(0, keys)
    assert cache.rows.heads == 2 and cache.bytes_per_token() == 256 + 2 * 4
    err = (out - keys).abs()
    assert (err[..., :128] <= keys[..., :128].abs().amax(-1, keepdim=True) * 2 ** -4).all()
    assert torch.equal(out[:, -32:], keys[:, -32:])  # the newest positions are kept exactly


@pytest.mark.parametrize("padded", [False, True])
def test_prefill_selection_mask_is_built_per_block(dsa_layer, monkeypatch, padded):
    """A prefill chunk (T > GATHER_MAX_T) attends to its selection through a mask built one key block at a time
    (dsa.selection_mask): the bits of the whole [B, T, S] mask, both attention paths, and no block of the mask
    is wider than the attention's key block."""
    from localmoe.engine import blockwise
    from localmoe.engine.layers import dsa, mla

    layer, c = dsa_layer, dsa_layer.config
    B, T, S, k = 2, 12, 300, 20
    q_nope, q_rope, rows, selected = _random_selection(c, 5, B, T, S, k, pads=3)
    pad = torch.ones(B, T, S, dtype=torch.bool)
    pad[1, :, :7] = False
    mask = pad if padded else None
    whole = _whole_selection_mask(selected, S)
    whole = whole & pad if padded else whole
    monkeypatch.setattr(mla, "SCORES_MAX_BYTES", 64 * 4 * B * c.num_heads * T)  # 64-key blocks
    widths = []
    block = dsa.selection_mask(selected, mask)
    monkeypatch.setattr(dsa, "selection_mask", lambda s, m: lambda lo, hi: widths.append(hi - lo) or block(lo, hi))
    step = Step(S - T, torch.arange(S - T, S)[None], mask, None, None)
    x = torch.zeros(B, T, c.hidden_size)
    for absorb in (True, False):
        layer.absorb = absorb
        try:
            want = layer.output(x, layer.attend(q_nope, q_rope, rows, whole))
            widths.clear()
            got = layer.attend_selected(x, q_nope, q_rope, rows, selected, step)
        finally:
            layer.absorb = None
        assert torch.equal(got, want)
        assert len(widths) == -(-S // 64) and max(widths) == 64
    assert blockwise.MIN_BLOCK == 64
