"""The fused MoE layer kernel (`mxfp4_moe`: gate/up GEMVs, GLU, down GEMV and the weighted sum of a
layer's routed experts in one call) against a float64 evaluation of the reference, and the
properties the engine relies on: per-expert calls give the same bits as one call, and the bits do
not depend on the thread count."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels import mxfp4_moe
from localmoe.kernels.mxfp4_moe import GLU_KINDS, ExpertTable, cpu, glu, naive_mxfp4_moe

from localmoe.quant.mxfp4 import dequantize, quantize

needs_cpu_kernel = pytest.mark.skipif(cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")

GLUS = [("swiglu", (0.0, 0.0)), ("swiglu", (0.4, 0.0)), ("gpt_oss", (7.0, 1.702)), ("situ", (4.0, 25.0))]
GLU_IDS = ["swiglu", "swiglu-clamped", "gpt_oss", "situ"]


def _proj(rows: int, cols: int, g: torch.Generator, bias: bool, bias_dtype=torch.float32) -> SimpleNamespace:
    packed, scales = quantize(torch.randn(rows, cols, generator=g) * 0.15)
    return SimpleNamespace(packed=packed, scales=scales,
                           bias=(torch.randn(rows, generator=g) * 0.1).to(bias_dtype) if bias else None)


def _experts(E: int, D: int, I: int, seed: int, bias: bool = True, bias_dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {e: SimpleNamespace(gate=_proj(I, D, g, bias, bias_dtype), up=_proj(I, D, g, bias, bias_dtype),
                               down=_proj(D, I, g, bias, bias_dtype)) for e in range(E)}


def _routing(N: int, E: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [N, k] (distinct experts per token), weights [N, k]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(N, E, generator=g).topk(k, dim=-1).indices
    return ids, torch.rand(N, k, generator=g)


def _linear64(h, packed, scales, bias):
    return F.linear(h, dequantize(packed, scales, torch.float64), None if bias is None else bias.double())


def _float64(x, ids, weights, experts, kind, params) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    return naive_mxfp4_moe(x.double(), ids, weights.double(), experts, kind, params, out, linear=_linear64)


def test_glu_reference_formulas():
    """reference.glu against the formulas written out per element in float64."""
    g = torch.linspace(-30, 30, 37, dtype=torch.float64)
    u = torch.linspace(40, -40, 37, dtype=torch.float64)

    def sig(v):
        return 1 / (1 + math.exp(-v))

    expected = {
        ("swiglu", 0.0): lambda a, b: a * sig(a) * b,
        ("swiglu", 7.0): lambda a, b: min(a, 7.0) * sig(min(a, 7.0)) * max(-7.0, min(b, 7.0)),
        ("gpt_oss", 7.0): lambda a, b: (max(-7.0, min(b, 7.0)) + 1) * min(a, 7.0) * sig(1.702 * min(a, 7.0)),
        ("situ", 4.0): lambda a, b: 4 * math.tanh(a / 4) * sig(a) * 25 * math.tanh(b / 25),
    }
    for (kind, p0), fn in expected.items():
        got = glu(kind, g, u, p0, 1.702 if kind == "gpt_oss" else 25.0)
        for a, b, out in zip(g.tolist(), u.tolist(), got.tolist()):
            assert math.isclose(out, fn(a, b), rel_tol=1e-12, abs_tol=1e-12), (kind, a, b)
    with pytest.raises(ValueError, match="expert activation"):
        glu("gelu", g, u, 0.0, 0.0)


@needs_cpu_kernel
@pytest.mark.parametrize("N", [1, 2, 3, 9, 63], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("kind,params", GLUS, ids=GLU_IDS)
def test_cpu_layer_matches_float64(kind, params, N, close):
    E, D, I, k = 7, 96, 64, 3
    experts = _experts(E, D, I, seed=N)
    ids, weights = _routing(N, E, k, seed=N + 1)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(N + 2))
    x[:, 5] *= 30  # one large channel: the gates reach the GLU's clamps and saturations
    got = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), kind, params, torch.zeros(N, D))
    close(got, _float64(x, ids, weights, experts, kind, params), 2e-6, f"{kind} N={N}")


@needs_cpu_kernel
@pytest.mark.parametrize("kind,params", GLUS, ids=GLU_IDS)
def test_per_expert_calls_give_the_same_bits(kind, params):
    """A paging provider holds one expert at a time and calls once per expert in increasing id."""
    E, D, I, k, N = 6, 64, 96, 2, 5
    experts = _experts(E, D, I, seed=3)
    ids, weights = _routing(N, E, k, seed=4)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(5))
    whole = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), kind, params, torch.zeros(N, D))
    split = torch.zeros(N, D)
    for e in ids.unique().tolist():
        mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable({e: experts[e]}, E), kind, params, split, only=e)
    assert torch.equal(whole, split)


@needs_cpu_kernel
def test_one_expert_call_needs_scratch_for_its_own_rows_only():
    """A per-expert call (`only`) lays its scratch out for that expert's assignments alone: a prefill
    chunk's call needs its rows, not the chunk's N * k. Run with a scratch of exactly that size and a
    guard after it: the guard stays untouched and the bits equal the whole layer's."""
    E, D, I, k, N = 6, 64, 96, 2, 40
    experts = _experts(E, D, I, seed=3)
    ids, weights = _routing(N, E, k, seed=4)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(5))
    table = ExpertTable(experts, E)
    whole = mxfp4_moe.mxfp4_moe(x, ids, weights, table, "situ", (4.0, 25.0), torch.zeros(N, D))
    lib, split = cpu.library(), torch.zeros(N, D)
    for e in ids.unique().tolist():
        rows = int((ids == e).sum())
        need = lib.mxfp4_moe_scratch(rows, D, I)
        assert need < lib.mxfp4_moe_scratch(N * k, D, I) // 2
        scratch = torch.full((need + 4096,), 0xA5, dtype=torch.uint8)
        lib.mxfp4_moe(x.data_ptr(), N, D, I, k, ids.data_ptr(), weights.data_ptr(), table.addresses.data_ptr(), E, e,
                      GLU_KINDS.index("situ"), 4.0, 25.0, split.data_ptr(), scratch.data_ptr(), 1, 0)
        assert bool((scratch[need:] == 0xA5).all()), f"expert {e} wrote past its {need} bytes"
    assert torch.equal(whole, split)


@needs_cpu_kernel
def test_cpu_layer_independent_of_threads():
    E, D, I, k, N = 8, 128, 64, 4, 3
    experts = _experts(E, D, I, seed=6)
    ids, weights = _routing(N, E, k, seed=7)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(8))
    table = ExpertTable(experts, E)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = mxfp4_moe.mxfp4_moe(x, ids, weights, table, "gpt_oss", (7.0, 1.702), torch.zeros(N, D))
        torch.set_num_threads(max(2, threads))
        more = mxfp4_moe.mxfp4_moe(x, ids, weights, table, "gpt_oss", (7.0, 1.702), torch.zeros(N, D))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, more)


@needs_cpu_kernel
def test_bf16_biases_and_accumulating_into_out(close):
    """Store extents keep biases in bf16 (the table converts them, exactly); `out` is added to."""
    E, D, I, k, N = 4, 64, 64, 2, 2
    experts = _experts(E, D, I, seed=9, bias_dtype=torch.bfloat16)
    ids, weights = _routing(N, E, k, seed=10)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(11))
    start = torch.randn(N, D, generator=torch.Generator().manual_seed(12))
    got = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), "swiglu", (0.0, 0.0), start.clone())
    close(got - start, _float64(x, ids, weights, experts, "swiglu", (0.0, 0.0)), 2e-6, "bf16 bias")


def test_many_tokens_and_no_kernel_use_the_reference_loop(monkeypatch, close):
    """Past GEMV_MAX_TOKENS tokens (and without the library) the dispatcher runs the per-expert loop."""
    E, D, I, k = 4, 64, 32, 2
    N = mxfp4_moe.GEMV_MAX_TOKENS + 5
    experts = _experts(E, D, I, seed=13, bias=False)
    ids, weights = _routing(N, E, k, seed=14)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(15))
    want = _float64(x, ids, weights, experts, "situ", (4.0, 25.0))
    close(mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), "situ", (4.0, 25.0), torch.zeros(N, D)),
          want, 2e-6, "many tokens")
    monkeypatch.setattr(cpu, "library", lambda: None)
    few = slice(0, 3)
    close(mxfp4_moe.mxfp4_moe(x[few], ids[few], weights[few], ExpertTable(experts, E), "situ", (4.0, 25.0),
                              torch.zeros(3, D)),
          _float64(x[few], ids[few], weights[few], experts, "situ", (4.0, 25.0)), 2e-6, "no library")


@needs_cpu_kernel
@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_prefill_runs_the_kernel_per_expert_with_few_tokens(monkeypatch, precision, close):
    """More than GEMV_MAX_TOKENS tokens: an expert with at most EXPERT_GEMV_MAX_TOKENS of them goes through the kernel (its codes
    read once for all its tokens), one with more through the reference; one call over the layer and one
    call per expert (a paging provider) give the same bits, and the sum matches float64."""
    E, D, I, k = 8, 64, 32, 2
    N = 2 * mxfp4_moe.GEMV_MAX_TOKENS
    experts = _experts(E, D, I, seed=16, bias=False)
    ids, weights = _routing(N, E, k, seed=17)
    monkeypatch.setattr(mxfp4_moe, "EXPERT_GEMV_MAX_TOKENS", N // 2)
    ids[:, 0] = 0  # expert 0 gets every token: more than EXPERT_GEMV_MAX_TOKENS; the others fewer
    ids[:, 1] = torch.where(ids[:, 1] == 0, 1, ids[:, 1])
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(18))
    calls = []
    moe = cpu.moe
    monkeypatch.setattr(cpu, "moe", lambda *a, **kw: calls.append(a[8]) or moe(*a, **kw))
    whole = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), "situ", (4.0, 25.0), torch.zeros(N, D),
                                precision=precision)
    assert calls == sorted(set(ids[:, 1].tolist()))  # every expert but 0, one kernel call each
    split = torch.zeros(N, D)
    for e in ids.unique().tolist():
        mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable({e: experts[e]}, E), "situ", (4.0, 25.0), split, only=e,
                            precision=precision)
    assert torch.equal(whole, split)
    if precision == "exact":
        close(whole, _float64(x, ids, weights, experts, "situ", (4.0, 25.0)), 2e-6, "prefill")


@needs_cpu_kernel
def test_single_expert_tables_are_reused_for_the_same_memory():
    """ExpertTable.single (a pager's per-expert calls): views of the same slot memory get the kept table,
    also when a call needs fewer rows; experts with biases are built each time; the bits are those of a
    fresh table."""
    E, D, I, k, N = 6, 64, 32, 2, 4
    experts = _experts(E, D, I, seed=19, bias=False)
    ids, weights = _routing(N, E, k, seed=20)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(21))
    e = int(ids[0, 0])

    def view(w):  # what a pager hands out again: new objects over the same memory
        return SimpleNamespace(**{p: SimpleNamespace(packed=getattr(w, p).packed[:], scales=getattr(w, p).scales[:],
                                                     bias=None) for p in ("gate", "up", "down")})

    first = ExpertTable.single(e, view(experts[e]), E)
    assert ExpertTable.single(e, view(experts[e]), E) is first
    assert ExpertTable.single(e, view(experts[e]), e + 1) is first
    assert ExpertTable.single(e + E, view(experts[e]), 2 * E) is not first  # another expert id: its own table
    got = mxfp4_moe.mxfp4_moe(x, ids, weights, first, "situ", (4.0, 25.0), torch.zeros(N, D), only=e)
    fresh = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable({e: experts[e]}, E), "situ", (4.0, 25.0),
                                torch.zeros(N, D), only=e)
    assert torch.equal(got, fresh)
    biased = _experts(1, D, I, seed=22)[0]
    assert ExpertTable.single(0, biased, 1) is not ExpertTable.single(0, biased, 1)


def test_expert_table_takes_only_mxfp4_experts():
    experts = _experts(2, 64, 32, seed=16)
    assert all(ExpertTable.holds(w) for w in experts.values())
    dense = SimpleNamespace(gate=SimpleNamespace(packed=None, scales=None, weight=torch.zeros(32, 64), bias=None),
                            up=experts[0].up, down=experts[0].down)
    assert not ExpertTable.holds(dense)
    with pytest.raises(ValueError, match="expert 1"):
        ExpertTable({0: experts[0], 1: dense}, 2)
    assert set(GLU_KINDS) == {"swiglu", "gpt_oss", "situ"}


@needs_cpu_kernel
@pytest.mark.parametrize("N", [1, 2, 5, 63, mxfp4_moe.GEMV_MAX_TOKENS + 4], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("kind,params", GLUS, ids=GLU_IDS)
@pytest.mark.parametrize("D,I", [(96, 64), (32, 64)], ids=lambda v: str(v))
def test_q8_layer_matches_float64_of_q8_rounded_inputs(kind, params, N, D, I):
    """precision "q8": the kernel (and past GEMV_MAX_TOKENS the reference loop) equals a float64
    evaluation whose projection inputs go through reference.q8_round. Widths of 1-3 blocks: a q8
    record (8 blocks) is then larger than an exact one, and the scratch must hold it."""
    E, k = 7, 3
    experts = _experts(E, D, I, seed=20 + N)
    ids, weights = _routing(N, E, k, seed=21 + N)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(22 + N))
    x[:, 5] *= 30
    got = mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable(experts, E), kind, params, torch.zeros(N, D),
                              precision="q8")
    want = naive_mxfp4_moe(x.double(), ids, weights.double(), experts, kind, params,
                           torch.zeros(N, D, dtype=torch.float64), linear=_linear64, precision="q8")
    # Per token: relative RMS within fp32 accumulation, except where a GLU output lies at a rounding
    # boundary of its block (the kernel computes the GLU in fp32, the reference in float64) and rounds
    # the other way: one step of 1/127 of the block's largest value moves that token by ~1e-4.
    errors = ((got.double() - want).norm(dim=1) / want.norm(dim=1)).tolist()
    flipped = [e for e in errors if e > 2e-6]
    assert len(flipped) <= max(1, N // 32) and max(errors) < 1e-3, (kind, N, flipped)


@needs_cpu_kernel
def test_q8_token_bits_do_not_depend_on_the_call():
    """Every group runs the same per-token path under q8, so a token's output is the same bits whether it
    is decoded alone, shares its experts with other tokens (prefill) or comes one expert at a time."""
    E, D, I, k, N = 6, 64, 96, 2, 11
    experts = _experts(E, D, I, seed=23)
    ids, weights = _routing(N, E, k, seed=24)
    x = torch.randn(N, D, generator=torch.Generator().manual_seed(25))
    table = ExpertTable(experts, E)
    batch = mxfp4_moe.mxfp4_moe(x, ids, weights, table, "gpt_oss", (7.0, 1.702), torch.zeros(N, D), precision="q8")
    for t in range(N):
        alone = mxfp4_moe.mxfp4_moe(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], table, "gpt_oss", (7.0, 1.702),
                                    torch.zeros(1, D), precision="q8")
        assert torch.equal(alone, batch[t:t + 1]), t
    split = torch.zeros(N, D)
    for e in ids.unique().tolist():
        mxfp4_moe.mxfp4_moe(x, ids, weights, ExpertTable({e: experts[e]}, E), "gpt_oss", (7.0, 1.702), split,
                            only=e, precision="q8")
    assert torch.equal(split, batch)


def test_q8_round_is_within_half_a_step_and_q8_differs_from_exact():
    """reference.q8_round: per 32-value block, at most half of amax / 127 from x, exact at amax and 0,
    and an all-zero block stays zero; the q8 layer is measurably not the exact one (the rounding runs)."""
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(26))
    x[1, 32:64] = 0
    r = mxfp4_moe.q8_round(x)
    step = x.view(4, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((r - x).view(4, 3, 32).abs() <= step / 2 * (1 + 1e-6)).all())
    assert torch.equal(r[1, 32:64], torch.zeros(32))
    top = x.view(4, 3, 32).abs().argmax(-1)
    assert torch.allclose(r.view(4, 3, 32).gather(-1, top[..., None]), x.view(4, 3, 32).gather(-1, top[..., None]))
    E, D, I, k, N = 4, 64, 64, 2, 3
    experts = _experts(E, D, I, seed=27)
    ids, weights = _routing(N, E, k, seed=28)
    xs = torch.randn(N, D, generator=torch.Generator().manual_seed(29))
    exact = _float64(xs, ids, weights, experts, "swiglu", (0.0, 0.0))
    q8 = naive_mxfp4_moe(xs.double(), ids, weights.double(), experts, "swiglu", (0.0, 0.0),
                         torch.zeros(N, D, dtype=torch.float64), linear=_linear64, precision="q8")
    rel = ((q8 - exact).norm() / exact.norm()).item()
    assert 1e-4 < rel < 3e-2, rel  # ~2^-8 per input value, averaged over dot products of 64
    with pytest.raises(ValueError, match="expert precision"):
        mxfp4_moe.mxfp4_moe(xs, ids, weights, ExpertTable(experts, E), "swiglu", (0.0, 0.0), torch.zeros(N, D),
                            precision="q4")


ROUTES = [("topk_softmax", None, False, 1.0), ("softmax", None, True, 1.0), ("softmax", None, False, 1.0),
          ("sigmoid", "bias", True, 2.5)]
ROUTE_IDS = ["topk_softmax", "softmax-renorm", "softmax", "sigmoid-corrected-scaled"]


def _router(E: int, R: int, seed: int, correction: bool):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(E, R, generator=g) * 0.3, torch.randn(E, generator=g) * 0.1,
            torch.randn(E, generator=g) * 0.2 if correction else None)


@needs_cpu_kernel
@pytest.mark.parametrize("N", [1, 5, 63], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("scoring,correction,renormalize,scaling", ROUTES, ids=ROUTE_IDS)
def test_cpu_routing_matches_float64(scoring, correction, renormalize, scaling, N, close):
    """The kernel's routing (route.h) against naive_route on float64 logits: the same experts, weights
    within fp32 rounding."""
    E, R, k = 16, 96, 4
    w, b, corr = _router(E, R, seed=N, correction=correction is not None)
    x = torch.randn(N, R, generator=torch.Generator().manual_seed(N + 1))
    weights, ids = mxfp4_moe.route_experts(x, w, b, corr, scoring, k, renormalize, scaling)
    want_w, want_ids = mxfp4_moe.naive_route(F.linear(x.double(), w.double(), b.double()), k, scoring,
                                             None if corr is None else corr.double(), renormalize, scaling)
    assert torch.equal(ids, want_ids)
    close(weights, want_w, 2e-6, f"{scoring} weights")


def test_naive_route_is_the_engines_route():
    """The kernels' routing reference against engine/layers/moe.py's `route` (torch.topk): the same experts and
    weights on random logits (no ties), for every scoring."""
    from localmoe.engine.layers.moe import RoutingRule, route

    logits = torch.randn(9, 16, generator=torch.Generator().manual_seed(30))
    corr = torch.randn(16, generator=torch.Generator().manual_seed(31)) * 0.2
    for scoring, correction, renormalize, scaling in ROUTES:
        c = corr if correction else None
        rule = RoutingRule(top_k=4, scoring=scoring, renormalize=renormalize, scaling=scaling)
        want_w, want_ids = route(logits, rule, c)
        got_w, got_ids = mxfp4_moe.naive_route(logits, 4, scoring, c, renormalize, scaling)
        assert torch.equal(got_ids, want_ids), scoring
        torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-7)


@needs_cpu_kernel
@pytest.mark.parametrize("precision", ["exact", "q8"])
@pytest.mark.parametrize("N", [1, 7], ids=lambda n: f"N{n}")
def test_routed_call_is_routing_then_experts_bit_for_bit(N, precision):
    """`mxfp4_routed_moe` (one call) gives the bits of `route_experts` then `mxfp4_moe` (what a paging
    provider's layer runs), latent width included: the router reads x [N, R], the experts h [N, D]."""
    E, R, D, I, k = 8, 80, 64, 96, 3
    experts = _experts(E, D, I, seed=32 + N)
    w, b, corr = _router(E, R, seed=33, correction=True)
    x = torch.randn(N, R, generator=torch.Generator().manual_seed(34))
    h = torch.randn(N, D, generator=torch.Generator().manual_seed(35))
    table = ExpertTable(experts, E)
    out, weights, ids = mxfp4_moe.mxfp4_routed_moe(x, w, b, corr, "sigmoid", k, True, 2.5, h, table, "situ",
                                                   (4.0, 25.0), torch.zeros(N, D), precision)
    want_w, want_ids = mxfp4_moe.route_experts(x, w, b, corr, "sigmoid", k, True, 2.5)
    assert torch.equal(ids, want_ids) and torch.equal(weights, want_w)
    want = mxfp4_moe.mxfp4_moe(h, want_ids, want_w, table, "situ", (4.0, 25.0), torch.zeros(N, D),
                               precision=precision)
    assert torch.equal(out, want)
