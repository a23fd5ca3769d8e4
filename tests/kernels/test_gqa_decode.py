"""GQA decode attention: the CPU kernel and the dispatcher against a float64 per-head loop written
here, over odd sizes, windows (first key), padding masks, sinks and strided cache views."""

from __future__ import annotations

import math

import pytest
import torch
from localmoe.kernels.gqa_decode import cpu, gqa_decode, naive_gqa_decode, naive_gqa_step, step_kernel_for

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


def _step_case(H, Hkv, D, rot, pos, seed, wdtype=torch.float32, bias=True, sinks=True, hidden=48):
    g = torch.Generator().manual_seed(seed)
    rows = (H + 2 * Hkv) * D
    wqkv = (torch.randn(rows, hidden, generator=g) * 0.2).to(wdtype)
    wo = (torch.randn(hidden, H * D, generator=g) * 0.2).to(wdtype)
    bqkv = torch.randn(rows, generator=g) * 0.1 if bias else None
    bo = torch.randn(hidden, generator=g) * 0.1 if bias else None
    angle = torch.rand(rot // 2, generator=g) * 6
    cos, sin = torch.cat([angle.cos(), angle.cos()]), torch.cat([-angle.sin(), angle.sin()])  # signed sin
    pool = torch.randn(2, 1, Hkv, pos + 9, D, generator=g)  # [keys | values], room past pos
    sink = torch.randn(H, generator=g) if sinks else None
    x = torch.randn(1, 1, hidden, generator=g)
    return x, wqkv, bqkv, wo, bo, cos, sin, pool, sink


@needs_cpu_kernel
@pytest.mark.parametrize("H,Hkv,D,rot,pos,first", [(4, 2, 16, 16, 0, 0), (4, 2, 16, 8, 70, 0), (6, 3, 64, 64, 130, 100),
                                                   (4, 1, 8, 8, 5, 3)], ids=["pos0", "partial-rope", "window", "mqa"])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("extras", [True, False], ids=["bias-sinks", "plain"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["", "qknorm"])
def test_fused_step_matches_float64(H, Hkv, D, rot, pos, first, wdtype, extras, qk_norm, close):
    """The fused decode step (QKV GEMV, q/k norms, RoPE, cache write, attention, output GEMV in one call)
    against the reference step in float64 on the same (bf16-valued) weights: output and the written
    cache rows."""
    x, wqkv, bqkv, wo, bo, cos, sin, pool, sink = _step_case(H, Hkv, D, rot, pos, seed=pos + D, wdtype=wdtype,
                                                             bias=extras, sinks=extras)
    g = torch.Generator().manual_seed(D)
    norms = (1 + 0.3 * torch.randn(D, generator=g), 1 + 0.3 * torch.randn(D, generator=g)) if qk_norm else (None, None)
    kernel = step_kernel_for(wqkv, bqkv, wo, bo, H, Hkv, D, rot, sink, D ** -0.5, *norms, 1e-6)
    assert kernel is not None
    want_pool = pool.double()[:, 0].clone()
    want = naive_gqa_step(x.view(-1).double(), wqkv, bqkv, H, Hkv, rot, cos, sin, want_pool[0], want_pool[1], pos,
                          first, sink, D ** -0.5, wo, bo, *norms, 1e-6)
    got = kernel(x, cos, sin, pool[0], pool[1], pos, first)
    close(got.view(-1), want, 2e-6, "step output")
    close(pool[:, 0, :, pos], want_pool[:, :, pos], 2e-6, "written k, v")
    assert torch.equal(pool[:, 0, :, :pos].double(), want_pool[:, :, :pos])  # earlier positions untouched


def test_fused_step_declines_what_it_cannot_run():
    _, wqkv, bqkv, wo, bo, _, _, _, sink = _step_case(4, 2, 16, 16, 3, seed=1)
    assert step_kernel_for(wqkv.half(), bqkv, wo, bo, 4, 2, 16, 16, sink, 0.25) is None  # fp16 weights
    assert step_kernel_for(wqkv, bqkv, wo, bo, 4, 2, 12, 12, sink, 0.25) is None  # rows != (H + 2 Hkv) D
    assert step_kernel_for(wqkv, bqkv.double(), wo, bo, 4, 2, 16, 16, sink, 0.25) is None
    assert step_kernel_for(wqkv, bqkv, wo, bo, 4, 2, 16, 15, sink, 0.25) is None  # odd rotary dims
    assert step_kernel_for(wqkv, bqkv, wo, bo, 4, 2, 16, 16, sink, 0.25, torch.ones(16), None) is None  # q norm alone


def test_reference_step_rotates_like_the_engine():
    """naive_gqa_step's RoPE is engine/rope.py's apply_rope on the same tables (so the float64 test above
    checks the kernel against what the engine computes op by op)."""
    from localmoe.engine.rope import RotaryTable, apply_rope

    H, Hkv, D, pos = 2, 1, 16, 9
    x, wqkv, _, wo, _, _, _, pool, _ = _step_case(H, Hkv, D, D, pos, seed=2)
    table = RotaryTable(D, 10000.0, None, 64)
    cos, sin = table.at(torch.tensor([[pos]]))
    naive_gqa_step(x.view(-1), wqkv, None, H, Hkv, D, cos.view(-1), sin.view(-1), pool[0, 0], pool[1, 0], pos, 0,
                   None, 0.25, wo, None)
    k = (x.view(-1) @ wqkv.T)[H * D:(H + Hkv) * D].view(1, 1, Hkv, D)
    torch.testing.assert_close(pool[0, 0, :, pos], apply_rope(k, cos, sin)[0, 0], rtol=1e-6, atol=1e-6)
