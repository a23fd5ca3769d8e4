"""GQA decode attention: the CPU kernel and the dispatcher against a float64 per-head loop written
here, over odd sizes, windows (first key), padding masks, sinks and strided cache views; the batched
kernel over N sequences' paged caches (shuffled block tables, rows sharing a cache) likewise, and a
row's bits the same alone or batched."""

from __future__ import annotations

import math

import pytest
import torch
from localmoe.kernels.gqa_decode import (
    PagedKV,
    cpu,
    gqa_decode,
    gqa_decode_paged,
    naive_gqa_decode,
    naive_gqa_decode_paged,
    naive_gqa_step,
    step_kernel_for,
)

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


def _paged_case(N, H, Hkv, D, block, positions, share, seed, pages=None):
    """N rows' q/k/v and caches: row n's sequence holds random keys/values at positions < positions[n] in
    pools of `pages` blocks whose tables are shuffled (keys and values differently); `share`: pairs
    (n, m) where row m is row n's sequence at the next position (a verify's consecutive rows)."""
    g = torch.Generator().manual_seed(seed)
    positions = list(positions)
    caches = []
    for n in range(N):
        pages_n = pages or positions[n] // block + 3
        caches.append(PagedKV(torch.randn(Hkv, pages_n, block, D, generator=g) * 1.5,
                              torch.randperm(pages_n, generator=g), torch.randn(Hkv, pages_n, block, D, generator=g),
                              torch.randperm(pages_n, generator=g)))
    for n, m in share:
        caches[m], positions[m] = caches[n], positions[n] + 1
    q, k, v = (torch.randn(N, h, D, generator=g) for h in (H, Hkv, Hkv))
    return q, k, v, caches, positions


def _copies(caches: list[PagedKV]) -> list[PagedKV]:
    """Fresh pools (the kernel writes them), the same sharing between rows."""
    made: dict[int, PagedKV] = {}
    return [made.setdefault(id(c), PagedKV(c.key_pool.clone(), c.key_table, c.value_pool.clone(), c.value_table))
            for c in caches]


def _gathered(c: PagedKV, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache's positions < length as contiguous [1, Hkv, length, D] (read through its table, here)."""
    block = c.key_pool.shape[2]
    keys = torch.stack([c.key_pool[:, int(c.key_table[s // block]), s % block] for s in range(length)], dim=1)
    values = torch.stack([c.value_pool[:, int(c.value_table[s // block]), s % block] for s in range(length)], dim=1)
    return keys[None], values[None]


PAGED = [  # N, H, Hkv, D, block, positions, window, sinks, share
    pytest.param(1, 9, 3, 64, 256, [0], 0, False, [], id="N1-pos0"),
    pytest.param(3, 12, 4, 64, 8, [5, 70, 17], 0, True, [], id="N3-block8-sinks"),
    pytest.param(5, 8, 2, 32, 16, [40, 40, 3, 100, 7], 24, True, [(0, 1)], id="N5-window-shared"),
    pytest.param(17, 4, 4, 8, 4, [i * 7 % 23 for i in range(17)], 0, False, [(2, 3), (3, 4)], id="N17-mha-chain"),
    pytest.param(2, 16, 1, 128, 256, [300, 1], 5, True, [], id="N2-mqa-D128-two-blocks"),
]


@needs_cpu_kernel
@pytest.mark.parametrize("N,H,Hkv,D,block,positions,window,sinks,share", PAGED)
def test_paged_kernel_matches_float64(N, H, Hkv, D, block, positions, window, sinks, share, close):
    """Each row: its k/v written at its position through the table (exactly), then its attention over its
    own keys against float64; the reference (naive_gqa_decode_paged) writes the same pools and agrees too.
    Tolerance: fp32 sums of n terms err ~sqrt(n) units of 2^-24 (relative RMS); n = D (a score) + the
    keys (the softmax-weighted sum), x4 for exp's ~2 ulp and the final division."""
    q, k, v, caches, positions = _paged_case(N, H, Hkv, D, block, positions, share, seed=N + D)
    firsts = [max(0, p + 1 - window) if window else 0 for p in positions]
    sink = torch.randn(H, generator=torch.Generator().manual_seed(1)) if sinks else None
    tol = 4 * 2 ** -24 * math.sqrt(D + max(positions) + 1)
    assert cpu.paged_supported(q, k, v, caches)
    mine, ref = _copies(caches), _copies(caches)
    got = gqa_decode_paged(q, k, v, mine, positions, firsts, D ** -0.5, sink)
    want_ref = naive_gqa_decode_paged(q, k, v, ref, positions, firsts, D ** -0.5, sink)
    for n in range(N):
        keys, values = _gathered(mine[n], positions[n] + 1)
        assert torch.equal(keys[0, :, positions[n]], k[n]) and torch.equal(values[0, :, positions[n]], v[n]), n
        want = _float64(q[n:n + 1], keys, values, D ** -0.5, firsts[n], None, sink)
        close(got[n:n + 1], want, tol, f"kernel row {n}")
        close(want_ref[n:n + 1], want, tol, f"reference row {n}")
    for a, b in zip(mine, ref):  # the same pools written
        assert torch.equal(a.key_pool, b.key_pool) and torch.equal(a.value_pool, b.value_pool)


@needs_cpu_kernel
def test_paged_row_bits_do_not_depend_on_the_batch_or_threads():
    """Row n's output alone (N = 1) equals its row in a batch of 9 with other sequences (different lengths),
    on 1 and on 2 threads: the batched decode step's greedy output must not depend on who else runs."""
    q, k, v, caches, positions = _paged_case(9, 6, 2, 64, 16, [3, 90, 17, 200, 0, 45, 45, 8, 130], [(5, 6)], seed=3)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            outs.append(gqa_decode_paged(q, k, v, _copies(caches), positions, [0] * 9, 0.125))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1])
    for n in (0, 3, 8):  # a row whose cache no other row shares
        alone = gqa_decode_paged(q[n:n + 1], k[n:n + 1], v[n:n + 1], _copies([caches[n]]), [positions[n]], [0], 0.125)
        assert torch.equal(alone[0], outs[0][n]), n


def test_paged_falls_back_to_the_reference(close):
    """Where the kernel cannot read a cache (bf16 pools, D % 8 != 0) the dispatcher runs the reference."""
    q, k, v, caches, positions = _paged_case(2, 4, 2, 12, 8, [3, 9], [], seed=4)
    assert not cpu.paged_supported(q, k, v, caches)
    got = gqa_decode_paged(q, k, v, _copies(caches), positions, [0, 0], 0.3)
    close(got, naive_gqa_decode_paged(q, k, v, _copies(caches), positions, [0, 0], 0.3), 0, "reference path")
    q, k, v, caches, positions = _paged_case(1, 4, 2, 16, 8, [3], [], seed=5)
    half = [PagedKV(c.key_pool.bfloat16(), c.key_table, c.value_pool.bfloat16(), c.value_table) for c in caches]
    assert not cpu.paged_supported(q, k, v, half)


@needs_cpu_kernel
def test_paged_refuses_a_position_past_the_table():
    q, k, v, caches, _ = _paged_case(1, 4, 2, 16, 8, [3], [], seed=6, pages=2)
    with pytest.raises(AssertionError, match="past the cache"):
        gqa_decode_paged(q, k, v, caches, [16], [0], 0.25)
