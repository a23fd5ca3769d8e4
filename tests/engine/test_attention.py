"""Prefill attention with sinks or a sliding window (gpt-oss): the flash path (torch's CPU flash
kernel over the keys before the call and a causal band, merged with the sinks by log-sum-exp)
against the explicit softmax over the whole score matrix, and which calls take it."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers.attention import GQAttention, flash_available
from localmoe.engine.step import Step

pytestmark = pytest.mark.skipif(not flash_available(torch.zeros(1), torch.zeros(1), torch.zeros(1)),
                                reason="this torch has no CPU flash attention op")


def _attention(window: int, sinks: bool, kv_heads: int = 2, group: int = 3, head_dim: int = 16) -> GQAttention:
    """The attention math alone (no projections): what _flash and _explicit read."""
    a = GQAttention.__new__(GQAttention)
    a.heads, a.kv_heads, a.head_dim, a.group = kv_heads * group, kv_heads, head_dim, group
    a.window, a.scale, a.sparse_topk, a.record_selection = window, head_dim ** -0.5, None, False
    a.head_sinks = torch.randn(kv_heads * group, generator=torch.Generator().manual_seed(7)) if sinks else None
    a.sinks = None if a.head_sinks is None else a.head_sinks.view(kv_heads, group, 1, 1)
    return a


@pytest.mark.parametrize("window", [0, 5, 64], ids=lambda w: f"window{w}")
@pytest.mark.parametrize("sinks", [False, True], ids=["no-sinks", "sinks"])
@pytest.mark.parametrize("start,T", [(0, 2), (0, 40), (33, 9), (100, 50), (3, 130)], ids=lambda v: str(v))
def test_flash_equals_the_explicit_softmax(window, sinks, start, T):
    a = _attention(window, sinks)
    g = torch.Generator().manual_seed(start * 1000 + T)
    S, rows = start + T, a.group * T
    q = torch.randn(1, a.kv_heads, rows, a.head_dim, generator=g) * 3
    keys = torch.randn(1, a.kv_heads, S, a.head_dim, generator=g) * 3
    values = torch.randn(1, a.kv_heads, S, a.head_dim, generator=g)
    mask = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)[None]
    want = a._explicit(q, keys, values, Step(start, None, None, None, mask), T)
    got = a._flash(q, keys, values, start, T)
    assert (got - want).norm() / want.norm() < 1e-6


def test_only_fp32_cpu_tensors_take_the_flash_kernel():
    x = torch.zeros(1, 1, 2, 8)
    assert flash_available(x, x, x)
    assert not flash_available(x, x.bfloat16(), x)


def test_a_failing_flash_op_falls_back_to_the_explicit_softmax(monkeypatch):
    """A torch whose private flash op fails (changed or broken): one warning, then the explicit path."""
    from localmoe.engine.layers import attention

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setitem(attention._flash_cpu, "op", broken)
    a = _attention(5, True)
    q, keys, values = torch.randn(1, 2, 3 * 4, 16), torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16)
    with pytest.warns(UserWarning, match="flash attention failed"):
        assert attention.flash_or_none(lambda: a._flash(q, keys, values, 0, 4)) is None
    assert not flash_available(q, keys, values)
