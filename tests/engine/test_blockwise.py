"""blockwise_attention (engine/blockwise.py) against a plain masked softmax over every key."""

import pytest
import torch

from localmoe.engine.blockwise import MIN_BLOCK, blockwise_attention


def reference(q, keys, values, visible, scale):
    """q [B, H, T, d], keys/values [B, H, S, *], visible [B|1, 1, T, S] -> fp64 softmax attention."""
    scores = (q.double() @ keys.double().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(-1) @ values.double()).float()


def causal(T, S):
    return (torch.arange(S)[None, :] <= torch.arange(S - T, S)[:, None])[None, None]


@pytest.mark.parametrize("T,S", [(1, 1), (1, 300), (63, 63), (63, 500), (200, 500)], ids=lambda v: str(v))
@pytest.mark.parametrize("max_bytes", [0, 1 << 30], ids=["blocks", "one-block"])
def test_causal_equals_full_softmax(T, S, max_bytes):
    g = torch.Generator().manual_seed(T * 1000 + S)
    B, H, d, dv = 2, 3, 24, 16
    q, keys, values = (torch.randn(B, H, n, k, generator=g) for n, k in ((T, d), (S, d), (S, dv)))
    out = blockwise_attention(q, lambda lo, hi: (keys[:, :, lo:hi], values[:, :, lo:hi]), S, None, 0.3,
                              max_bytes=max_bytes)
    torch.testing.assert_close(out, reference(q, keys, values, causal(T, S), 0.3), rtol=1e-5, atol=1e-5)


def test_padding_mask_with_rows_that_see_nothing_in_early_blocks():
    """Left padding: row 1's queries see no key in the first blocks (all -inf there), then some."""
    g = torch.Generator().manual_seed(5)
    B, H, T, S, d = 2, 2, 40, 4 * MIN_BLOCK + 9, 8
    q, keys, values = (torch.randn(B, H, n, d, generator=g) for n in (T, S, S))
    mask = causal(T, S)[:, 0].expand(B, T, S).clone()
    mask[1, :, :3 * MIN_BLOCK] = False
    out = blockwise_attention(q, lambda lo, hi: (keys[:, :, lo:hi], values[:, :, lo:hi]), S, mask, 0.5, max_bytes=0)
    torch.testing.assert_close(out, reference(q, keys, values, mask[:, None], 0.5), rtol=1e-5, atol=1e-5)


def test_folded_heads_share_one_key_row_and_the_mask():
    """q [B, 1, H*T, d] (MLA's absorbed layout, row h*T + t) over keys [B, 1, S, d]: the mask of query t
    applies to every head's row t."""
    g = torch.Generator().manual_seed(6)
    B, H, T, S, d = 1, 4, 30, 3 * MIN_BLOCK, 12
    q = torch.randn(B, H, T, d, generator=g)
    keys = torch.randn(B, 1, S, d, generator=g)
    out = blockwise_attention(q.reshape(B, 1, H * T, d), lambda lo, hi: (keys[:, :, lo:hi], keys[:, :, lo:hi]), S,
                              None, 0.2, (H, T), max_bytes=0)
    expected = reference(q, keys.expand(B, H, S, d), keys.expand(B, H, S, d), causal(T, S), 0.2)
    torch.testing.assert_close(out.view(B, H, T, d), expected, rtol=1e-5, atol=1e-5)


def test_one_block_is_the_plain_softmax_bit_for_bit():
    g = torch.Generator().manual_seed(7)
    q, keys, values = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 9, 8, generator=g), \
        torch.randn(1, 2, 9, 4, generator=g)
    scores = (q @ keys.transpose(-1, -2)) * 0.25
    scores = scores.masked_fill(~causal(5, 9), float("-inf"))
    out = blockwise_attention(q, lambda lo, hi: (keys[:, :, lo:hi], values[:, :, lo:hi]), 9, None, 0.25)
    assert torch.equal(out, scores.softmax(-1) @ values)

