"""kernels/dense_moe: one routed expert with dense matrices over its tokens, against the op-by-op torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels import _cpu, dense_moe
from localmoe.kernels.dense_moe import cpu, naive_dense_expert

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")

T, D, I = 70, 40, 28  # odd sizes: a column tail past the 8-wide steps, row blocks of 3 with a remainder
ACTS = [("swiglu", (0.0, 0.0)), ("swiglu", (7.0, 0.0)), ("gpt_oss", (7.0, 1.702)), ("situ", (3.0, 2.0))]


def _case(n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g)
    rows = torch.randperm(T, generator=g)[:n].sort().values
    weights = torch.rand(n, generator=g)
    mats = [(torch.randn(*shape, generator=g) / shape[1] ** 0.5).to(dtype) for shape in ((I, D), (I, D), (D, I))]
    out = torch.randn(T, D, generator=g)
    return x, rows, weights, mats, out


def _torch_path(x, rows, weights, mats, out):
    """What engine/layers/moe.py ran before: F.linear per projection, silu * up, then index_add_."""
    gate, up, down = (m.float() for m in mats)
    xs = x.index_select(0, rows)
    y = F.linear(F.silu(F.linear(xs, gate)) * F.linear(xs, up), down)
    return out.clone().index_add_(0, rows, y * weights[:, None])


def _rel(got, want):
    return ((got - want).double().norm() / want.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [1, 2, 9, 10, 11, 64], ids=lambda n: f"N{n}")  # AVX-512 passes: 9, 5 + 5, 6 + 5, 8 x 8
def test_matches_the_op_by_op_torch_path(n, dtype):
    x, rows, weights, mats, out = _case(n, dtype)
    want = _torch_path(x, rows, weights, mats, out)
    got = cpu.dense_expert(x, rows, weights, *mats, "swiglu", (0.0, 0.0), out.clone())
    assert _rel(got, want) <= 1e-5
    untouched = torch.ones(T, dtype=torch.bool).index_fill_(0, rows, False)
    assert torch.equal(got[untouched], out[untouched])  # only the expert's rows change


@pytest.mark.parametrize(("kind", "params"), ACTS, ids=[f"{k}-{p[0]:g}" for k, p in ACTS])
def test_every_activation_matches_the_reference(kind, params):
    x, rows, weights, mats, out = _case(9, torch.float32, seed=1)
    want = naive_dense_expert(x, rows, weights, *mats, kind, params, out.clone())
    got = cpu.dense_expert(x, rows, weights, *mats, kind, params, out.clone())
    assert _rel(got - out, want - out) <= 1e-5


def test_an_empty_expert_changes_nothing():
    x, rows, weights, mats, out = _case(0, torch.float32)
    got = dense_moe.dense_expert(x, rows, weights, *mats, "swiglu", (0.0, 0.0), out.clone())
    assert torch.equal(got, out)


def test_a_token_gets_the_same_bits_whatever_else_the_expert_computes():
    x, rows, weights, mats, out = _case(64, torch.float32, seed=2)
    zero = torch.zeros_like(out)
    alone = cpu.dense_expert(x, rows[5:6], weights[5:6], *mats, "swiglu", (0.0, 0.0), zero.clone())
    together = cpu.dense_expert(x, rows, weights, *mats, "swiglu", (0.0, 0.0), zero.clone())
    assert torch.equal(alone[rows[5]], together[rows[5]])


@pytest.mark.skipif(len(_cpu.supported_isas()) < 2, reason="this CPU runs the AVX2 kernels only")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_avx2_equals_avx512(dtype):
    x, rows, weights, mats, out = _case(33, dtype, seed=3)
    runs = []
    for isa in ("avx2", _cpu.supported_isas()[-1]):
        with _cpu.forced_isa(isa):
            runs.append(cpu.dense_expert(x, rows, weights, *mats, "situ", (3.0, 2.0), out.clone()))
    assert torch.equal(runs[0], runs[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_layer_call_equals_one_call_per_expert(dtype):
    g = torch.Generator().manual_seed(4)
    E, k = 6, 2
    x, out = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=g)
    experts = [tuple((torch.randn(*s, generator=g) / s[1] ** 0.5).to(dtype) for s in ((I, D), (I, D), (D, I)))
               for _ in range(E)]
    table = dense_moe.DenseExpertTable.of(experts)
    chosen = [1, 2, 4, 5]  # increasing ids, some skipped
    got = dense_moe.dense_moe_layer(x, ids, weights, table, chosen, "situ", (3.0, 2.0), out.clone())
    want = out.clone()
    for e in chosen:
        picks = (ids.reshape(-1) == e).nonzero().squeeze(1)
        cpu.dense_expert(x, picks // k, weights.reshape(-1)[picks], *experts[e], "situ", (3.0, 2.0), want)
    assert torch.equal(got, want)
    ref = out.clone()
    for e in chosen:
        picks = (ids.reshape(-1) == e).nonzero().squeeze(1)
        naive_dense_expert(x, picks // k, weights.reshape(-1)[picks], *experts[e], "situ", (3.0, 2.0), ref)
    assert _rel(got - out, ref - out) <= 1e-5


def test_a_token_routed_twice_to_one_expert_counts_twice():
    """The layer call takes every pick (kernels/_cpu/expert_rows.h), as the per-expert path does: a token that names
    one expert twice gets it once per weight. Expert 2 has more picks than the chunk has tokens (the rows' scratch
    holds T: the picks run in pieces), and the bits equal one dense_expert call over all of them."""
    g = torch.Generator().manual_seed(6)
    T3, k = 3, 3
    x = torch.randn(T3, D, generator=g)
    ids = torch.tensor([[2, 2, 2], [2, 2, 2], [4, 2, 2]])
    weights = torch.rand(T3, k, generator=g)
    experts = [tuple(torch.randn(*s, generator=g) / s[1] ** 0.5 for s in ((I, D), (I, D), (D, I))) for _ in range(5)]
    table = dense_moe.DenseExpertTable.of(experts)
    got = dense_moe.dense_moe_layer(x, ids, weights, table, [2, 4], "swiglu", (0.0, 0.0), torch.zeros_like(x))
    want, ref = torch.zeros_like(x), torch.zeros_like(x)
    for e in (2, 4):
        picks = (ids.reshape(-1) == e).nonzero().squeeze(1)
        cpu.dense_expert(x, picks // k, weights.reshape(-1)[picks], *experts[e], "swiglu", (0.0, 0.0), want)
        naive_dense_expert(x, picks // k, weights.reshape(-1)[picks], *experts[e], "swiglu", (0.0, 0.0), ref)
    assert torch.equal(got, want)
    assert _rel(got, ref) <= 1e-5
    once = dense_moe.dense_moe_layer(x, ids[:, :1], weights[:, :1], table, [2, 4], "swiglu", (0.0, 0.0),
                                     torch.zeros_like(x))
    assert not torch.equal(once, got)  # the repeats are counted


def test_a_table_refuses_experts_it_cannot_point_at():
    mats = [(torch.randn(I, D), torch.randn(I, D), torch.randn(D, I)) for _ in range(2)]
    assert dense_moe.DenseExpertTable.of(mats) is not None
    assert dense_moe.DenseExpertTable.of([mats[0], (mats[1][0], mats[1][1].half(), mats[1][2])]) is None
    assert dense_moe.DenseExpertTable.of([mats[0], (mats[1][0], mats[1][1], mats[1][2].T)]) is None
