"""GQA decode attention: the CPU kernel and the dispatcher against a float64 per-head loop written
here, over odd sizes, windows (first key), padding masks, sinks and strided cache views."""

from __future__ import annotations

import math

import pytest
import torch
from localmoe.kernels.gqa_decode import cpu, gqa_decode, naive_gqa_decode

needs_cpu_kernel = pytest.mark.skipif(cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")


def _float64(q, keys, values, scale, first=0, visible=None, sinks=None) -> torch.Tensor:
    """One head at a time: exp-normalised weights over the visible keys (plus the sink's mass)."""
    B, H, D = q.shape
    group = H // keys.shape[1]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kv = h // group
            seen = [s for s in range(first, keys.shape[2]) if visible is None or bool(visible[b, s])]
            logits = [float(q[b, h].double() @ keys[b, kv, s].double()) * scale for s in seen]
            extra = [] if sinks is None else [float(sinks[h])]
            if not logits:
                continue
            top = max(logits + extra)
            den = sum(math.exp(z - top) for z in logits + extra)
            for s, z in zip(seen, logits):
                out[b, h] += math.exp(z - top) / den * values[b, kv, s].double()
    return out


def _case(B, H, Hkv, S, D, seed, mask=False, sinks=False):
    g = torch.Generator().manual_seed(seed)
    qk = torch.randn(B, 1, H + Hkv, D, generator=g)  # q as the engine passes it: a strided view
    keys, values = torch.randn(B, Hkv, S, D, generator=g) * 1.5, torch.randn(B, Hkv, S, D, generator=g)
    visible = torch.rand(B, S, generator=g) > 0.3 if mask else None
    if visible is not None:
        visible[:, -1] = True  # the query sees itself
    return qk[:, 0, :H], keys, values, visible, torch.randn(H, generator=g) if sinks else None


CASES = [  # B, H, Hkv, S, D, first, mask, sinks
    pytest.param(1, 12, 4, 1, 64, 0, False, True, id="S1-sinks"),
    pytest.param(1, 12, 4, 63, 64, 0, False, False, id="S63"),
    pytest.param(2, 8, 2, 500, 32, 371, True, True, id="S500-window-mask-sinks"),
    pytest.param(3, 4, 4, 65, 8, 1, True, False, id="S65-mha-mask"),
    pytest.param(1, 16, 1, 130, 128, 0, False, True, id="S130-mqa-D128"),
]


@needs_cpu_kernel
@pytest.mark.parametrize("B,H,Hkv,S,D,first,mask,sinks", CASES)
def test_cpu_kernel_matches_float64(B, H, Hkv, S, D, first, mask, sinks, close):
    q, keys, values, visible, sink = _case(B, H, Hkv, S, D, seed=S + D, mask=mask, sinks=sinks)
    want = _float64(q, keys, values, D ** -0.5, first, visible, sink)
    close(cpu.gqa_decode(q, keys, values, D ** -0.5, first, visible, sink), want, 1e-6, "kernel")
    close(naive_gqa_decode(q, keys, values, D ** -0.5, first, visible, sink), want, 1e-6, "reference")


@needs_cpu_kernel
def test_strided_cache_views_and_threads():
    """K/V as views of a larger pool (the paged cache's identity table); bits independent of threads."""
    q, _, _, _, sink = _case(1, 8, 2, 1, 64, seed=1, sinks=True)
    pool = torch.randn(2, 1, 2, 256, 64)  # [K|V, B, Hkv, capacity, D]
    keys, values = pool[0].narrow(2, 0, 77), pool[1].narrow(2, 0, 77)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = gqa_decode(q, keys, values, 0.125, 10, None, sink)
        torch.set_num_threads(max(2, threads))
        more = gqa_decode(q, keys, values, 0.125, 10, None, sink)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, more)
    torch.testing.assert_close(one.double(), _float64(q, keys, values, 0.125, 10, None, sink), rtol=1e-5, atol=1e-6)


def test_a_head_that_sees_nothing_gets_zeros_and_odd_dims_use_the_reference(close):
    q, keys, values, _, _ = _case(1, 4, 2, 5, 12, seed=2)  # D = 12: not a multiple of 8
    assert not cpu.supported(q, keys, values)
    hidden = torch.zeros(1, 5, dtype=torch.bool)
    assert torch.equal(gqa_decode(q, keys, values, 0.3, 0, hidden), torch.zeros(1, 4, 12))
    close(gqa_decode(q, keys, values, 0.3, 2), _float64(q, keys, values, 0.3, 2), 1e-6, "reference path")
    q, keys, values, _, _ = _case(1, 4, 2, 5, 8, seed=3)
    assert torch.equal(gqa_decode(q, keys, values, 0.3, 0, hidden), torch.zeros(1, 4, 8))  # the kernel, if built
