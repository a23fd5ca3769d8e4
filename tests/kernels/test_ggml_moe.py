"""Routed experts from GGUF blocks in the fused decode step (kernels/ggml_gemv/ggml_moe_cpu.cpp `ggml_moe_token`,
bound by engine/decode_plan.py through the hybrid decode stack): one token's chosen experts in one call, its input
rounded to int8 once for all gate and up rows.

- the kernel against its reference (every projection dequantised by quant/ggml.py, x rounded to int8 per 32
  values, per 256 for K-quant rows, as the GEMV's reference does), for every block type with an int8 row kernel,
  types mixed per projection (a K-quant gate with a Q8_0 up: x rounded both ways);
  the same for `block_expert` (one expert over a prefill chunk's rows, `ggml_moe_expert`), and `block_layer` (a
  chunk's experts of a layer in one call, `ggml_moe_layer`) against one `block_expert` per expert, bit for bit;
- its AVX2 build against its AVX-512 one, bit for bit;
- Qwen3-MoE and GLM-4.5 GGUFs in llama.cpp's Q4_K_M layout (testing/moe_gguf.py) decoding through the plan with
  the experts in the kernel, against the op-by-op engine (<= 1e-5 of the logit range) and, paged at 25% RAM from a
  converted store (experts called back, one `dense_expert` each), bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from localmoe.kernels import _cpu
from localmoe.kernels.ggml_gemv.experts import BlockExpertTable, ggml_moe_token, naive_ggml_moe_token
from localmoe.kernels.mxfp4_moe import GLU_KINDS, glu

from localmoe.config import EngineConfig, PagingConfig
from localmoe.engine.quantized import BlockQuantized
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.ggml_blocks import random_blocks
from localmoe.testing.moe_gguf import write_moe_gguf

from .conftest import greedy_logits

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")

IQ4 = [(Q.IQ4_XS, Q.IQ4_XS, Q.IQ4_NL), (Q.IQ4_NL, Q.Q4_K, Q.IQ4_XS)]  # ggml_rows_iq4.h, alone and mixed
TYPES = [(Q.Q4_K, Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q5_K, Q.Q8_0), (Q.Q4_0, Q.Q4_1, Q.Q5_0), (Q.Q5_1, Q.Q8_0, Q.Q4_K),
         (Q.Q6_K, Q.Q8_0, Q.Q5_K), *IQ4]
CHUNK_TYPES = TYPES[:2] + IQ4[:1]
LAYER_TYPES = TYPES[:3] + IQ4[:1]


def _table(types, experts=6, hidden=512, inner=256, seed=0) -> BlockExpertTable:
    rng = np.random.default_rng(seed)

    def block(t, rows, cols):
        return BlockQuantized(torch.from_numpy(random_blocks(t, rows, cols, rng)), t, (rows, cols))

    table = BlockExpertTable.of([(block(types[0], inner, hidden), block(types[1], inner, hidden),
                                  block(types[2], hidden, inner)) for _ in range(experts)])
    assert table is not None
    return table


@pytest.mark.parametrize("types", TYPES, ids=["-".join(t.name for t in ts) for ts in TYPES])
@pytest.mark.parametrize("kind", ["swiglu", "gpt_oss"])
def test_token_matches_the_dequantised_reference(types, kind):
    table = _table(types)
    params = (0.0, 0.0) if kind == "swiglu" else (7.0, 1.702)
    x = torch.randn(table.hidden, generator=torch.Generator().manual_seed(1))
    ids, weights = [0, 2, 3, 5], [0.4, 0.1, 0.3, 0.2]
    got = ggml_moe_token(x, ids, weights, table, GLU_KINDS.index(kind), params, torch.zeros(table.hidden))
    want = naive_ggml_moe_token(x.double(), ids, weights, table,
                                lambda g, u: glu(kind, g.float(), u.float(), *params).double(),
                                torch.zeros(table.hidden, dtype=torch.float64))
    err = (got.double() - want).abs().max() / want.abs().max()
    assert err < 1e-5, f"{err:.2e} of the largest output"
    other = ggml_moe_token(x, ids[:3], weights[:3], table, GLU_KINDS.index(kind), params, torch.zeros(table.hidden))
    assert not torch.allclose(got, other)  # an expert left out is seen


@pytest.mark.parametrize("types", CHUNK_TYPES, ids=["-".join(t.name for t in ts) for ts in CHUNK_TYPES])
def test_chunk_expert_matches_the_reference_and_its_rows_alone(types):
    """`block_expert` (a prefill chunk's rows of one expert in one call) against the dequantised reference, and
    each row equal to the same row computed alone (the multi-row GEMV's rows are independent)."""
    from localmoe.kernels.ggml_gemv.experts import block_expert

    table = _table(types)
    x = torch.randn(11, table.hidden, generator=torch.Generator().manual_seed(3))
    rows, weights = torch.tensor([0, 2, 3, 7, 10]), torch.tensor([0.5, 0.25, 1.0, 0.75, 0.1])
    got = block_expert(x, rows, weights, table.experts[4], 0, (0.0, 0.0), torch.zeros_like(x))
    want = torch.zeros(11, table.hidden, dtype=torch.float64)
    for r, w in zip(rows.tolist(), weights.tolist()):
        naive_ggml_moe_token(x[r].double(), [4], [w], table, lambda g, u: glu("swiglu", g.float(), u.float(), 0.0, 0.0).double(),
                             want[r])
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    assert got[[1, 4, 5, 6, 8, 9]].abs().max() == 0  # rows not chosen stay untouched
    alone = block_expert(x, rows[3:4], weights[3:4], table.experts[4], 0, (0.0, 0.0), torch.zeros_like(x))
    assert torch.equal(alone[7], got[7])


@pytest.mark.parametrize("types", LAYER_TYPES, ids=["-".join(t.name for t in ts) for ts in LAYER_TYPES])
def test_chunk_layer_equals_one_expert_at_a_time(types):
    """`block_layer` (a prefill chunk's experts of a layer in one call) gives the bits of one `block_expert` per
    expert in the same order (the per-expert path a pager's experts take), only for the experts it is given."""
    from localmoe.kernels.ggml_gemv.experts import block_expert, block_layer

    table = _table(types)
    gen = torch.Generator().manual_seed(4)
    T, k = 37, 3  # the expert rows' scratch after 37 ids and 37 weights (a scratch that was too short)
    x = torch.randn(T, table.hidden, generator=gen)
    ids = torch.stack([torch.randperm(6, generator=gen)[:k] for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    chosen = sorted(set(ids.reshape(-1).tolist()))
    got = block_layer(x, ids, weights, table, chosen, 0, (0.0, 0.0), torch.zeros_like(x))
    want = torch.zeros_like(x)
    for e in chosen:
        picks = (ids.reshape(-1) == e).nonzero().squeeze(1)
        block_expert(x, picks // k, weights.reshape(-1)[picks], table.experts[e], 0, (0.0, 0.0), want)
    assert torch.equal(got, want)
    fewer = block_layer(x, ids, weights, table, chosen[1:], 0, (0.0, 0.0), torch.zeros_like(x))
    assert not torch.equal(fewer, got)  # only the experts given are added


def test_a_token_routed_twice_to_one_expert_counts_twice():
    """The layer call takes every pick (expert_rows.h), as the per-expert path does: a token that names one expert
    twice gets it once per weight. Here expert 2 has 3 picks per token, more picks than the chunk has tokens
    (the rows' scratch holds T: the picks run in pieces), and the bits equal one block_expert call over all of them."""
    from localmoe.kernels.ggml_gemv.experts import block_expert, block_layer

    table = _table(TYPES[0])
    gen = torch.Generator().manual_seed(5)
    T, k = 3, 3
    x = torch.randn(T, table.hidden, generator=gen)
    ids = torch.tensor([[2, 2, 2], [2, 2, 2], [4, 2, 2]])
    weights = torch.rand(T, k, generator=gen)
    got = block_layer(x, ids, weights, table, [2, 4], 0, (0.0, 0.0), torch.zeros_like(x))
    want = torch.zeros_like(x)
    for e in (2, 4):
        picks = (ids.reshape(-1) == e).nonzero().squeeze(1)
        block_expert(x, picks // k, weights.reshape(-1)[picks], table.experts[e], 0, (0.0, 0.0), want)
    assert torch.equal(got, want)
    once = block_layer(x, ids[:, :1], weights[:, :1], table, [2, 4], 0, (0.0, 0.0), torch.zeros_like(x))
    assert not torch.equal(once, got)  # the repeats are counted


def test_refuses_mixed_types_across_experts():
    a, b = _table(TYPES[0]), _table(TYPES[1])
    assert BlockExpertTable.of([a.experts[0], b.experts[0]]) is None
    assert BlockExpertTable.of([(torch.zeros(4, 4),) * 3]) is None  # not blocks


@pytest.mark.skipif("avx512vnni" not in _cpu.supported_isas(), reason="the CPU lacks AVX-512 VNNI")
def test_avx2_equals_avx512():
    for types in TYPES:
        table = _table(types)
        x = torch.randn(table.hidden, generator=torch.Generator().manual_seed(2))
        runs = []
        for isa in ("avx2", "avx512vnni"):
            with _cpu.forced_isa(isa):
                runs.append(ggml_moe_token(x, [1, 4], [0.7, 0.3], table, 0, (0.0, 0.0), torch.zeros(table.hidden)))
        assert torch.equal(*runs), types


# ---- whole models through the decode plan ----

PROMPT = list(range(3, 40))
STEPS = 8


@pytest.fixture(scope="module", params=["qwen3_moe", "glm4_moe"])
def gguf(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = write_checkpoint(request.param, root / "hf", size="tiny", seed=3)
    return write_moe_gguf(src, root / f"{request.param}.q4_k_m.gguf", "q4_k_m")


def _load(path, **kw):
    return load_model(path, EngineConfig(dtype="auto", max_context=64, expert_precision="q8", **kw),
                      progress=False).model


def _decode(model, planned: bool) -> torch.Tensor:
    """Logits [STEPS, V] of STEPS greedy decode steps after PROMPT; `planned`: through the decode plan."""
    return greedy_logits(model, PROMPT, STEPS, planned, 64)


def test_fused_matches_op_by_op(gguf):
    model = _load(gguf)
    want, got = _decode(model, False), _decode(model, True)
    blocks = [bool(layer.blocks) for layer in model._plan.decoder.layers if layer.moe]
    assert blocks and all(blocks)  # every MoE layer's experts ran in the kernel
    err = ((got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))).max().item()
    assert err < 1e-5, f"fused decode differs from op by op by {err:.2e} of the logit range"


def test_moe_head_rounds_its_input_at_q8(gguf):
    """A MoE GGUF's block lm_head (Q6_K in a Q4_K_M file, repacked at load: Q6_K_R8) at expert precision q8 reads its
    input rounded to int8 as the other block GEMVs do (per 256 values: the dequantised-weights reference on
    q8_round(x, 256)); at exact it keeps fp32 activations (and the file's layout)."""
    from localmoe.kernels.ggml_gemv import Q6_K_R8, naive_ggml_gemv
    from localmoe.kernels.mxfp4_moe import q8_round

    head = _load(gguf).lm_head
    assert (head.ggml_type, head.exact_x) == (Q6_K_R8, False)
    h = torch.randn(3, head.in_features, generator=torch.Generator().manual_seed(5))
    h[:, 7] *= 30  # one large channel: rounding per 256 is coarse elsewhere
    shape = (head.out_features, head.in_features)
    want = naive_ggml_gemv(h.double(), head.raw, head.ggml_type, shape)
    got = head(h)
    assert ((got.double() - want).abs().max() / want.abs().max()) < 1e-5
    torch.testing.assert_close(want, q8_round(h.double(), 256) @ naive_ggml_gemv(
        torch.eye(head.in_features, dtype=torch.float64), head.raw, head.ggml_type, shape, exact_x=True))
    exact = load_model(gguf, EngineConfig(dtype="auto", max_context=64, expert_precision="exact"),
                       progress=False).model.lm_head
    assert exact.exact_x and exact.ggml_type == Q.Q6_K
    assert not torch.allclose(exact(h), got, rtol=1e-4)


def test_paged_equals_resident(gguf, tmp_path, monkeypatch):
    """Paged experts reach the fused step through its callback, which runs a layer's held experts in one
    `ggml_moe_token` call over a held table of their slots (HeldBlockTable), the call resident ones make inside the
    step: the same rows, GLU and order, so the same bits. With one slot (experts one at a time: one `dense_expert`
    each) too."""
    from localmoe.convert import convert
    from localmoe.engine import decode_plan
    from localmoe.kernels.mxfp4_moe.held import HeldBlockTable
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    convert(gguf, tmp_path / "store", progress=False)
    store = PackedStore(tmp_path / "store")
    want = _decode(_load(gguf), True)
    filled, calls = [], []
    fill = HeldBlockTable.fill
    monkeypatch.setattr(HeldBlockTable, "fill",
                        lambda self, experts: (filled.append(fill(self, experts)), filled[-1])[1])
    monkeypatch.setattr(decode_plan, "ggml_moe_token", lambda *a, _real=decode_plan.ggml_moe_token: (
        calls.append(1), _real(*a))[1])
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    for budget in (expert_bytes(store) // 4, slot):
        filled.clear()
        calls.clear()
        paged = _load(tmp_path / "store", paging=PagingConfig(ram_budget=budget))
        assert isinstance(paged.moe_blocks()[0].experts, Pager)
        got = _decode(paged, True)
        assert not any(layer.blocks for layer in paged._plan.decoder.layers)
        assert torch.equal(got, want)
        if budget > slot:
            assert filled and all(filled) and len(calls) == len(filled)
        else:
            assert calls == []


@pytest.mark.parametrize("types", ["iq4_xs", "iq4_nl"])
def test_iq4_experts_run_from_their_blocks(tmp_path, types):
    """A Qwen3-MoE GGUF in IQ4_XS / IQ4_NL (ggml_rows_iq4.h): every MoE layer's experts in the fused kernel, decode
    within 1e-5 of the logit range of the op-by-op engine, and paged at 25% from its store == resident, bit for bit."""
    from localmoe.convert import convert
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    src = write_checkpoint("qwen3_moe", tmp_path / "hf", size="tiny", seed=3)
    path = write_moe_gguf(src, tmp_path / f"qwen3_moe.{types}.gguf", types)
    model = _load(path)
    w = model.moe_blocks()[0].experts.get(0, 1)
    assert w.gate.weight.ggml_type.name == types.upper()
    want, got = _decode(model, False), _decode(model, True)
    blocks = [bool(layer.blocks) for layer in model._plan.decoder.layers if layer.moe]
    assert blocks and all(blocks)  # the experts ran in the kernel, not dequantised
    err = ((got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))).max().item()
    assert err < 1e-5, f"fused decode differs from op by op by {err:.2e} of the logit range"
    convert(path, tmp_path / "store", progress=False)
    paged = _load(tmp_path / "store", paging=PagingConfig(ram_budget=expert_bytes(PackedStore(tmp_path / "store")) // 4))
    assert isinstance(paged.moe_blocks()[0].experts, Pager)
    assert torch.equal(_decode(paged, True), got)


def test_prefill_runs_each_moe_layer_in_one_call(gguf, monkeypatch):
    """Resident block experts at q8: a prefill chunk's MoE layer is one `block_layer` call (no per-expert call);
    test_paged_equals_resident checks its bits against the pager's one `block_expert` per expert."""
    from localmoe.kernels.ggml_gemv import experts as ggml_experts

    model = _load(gguf)
    calls = {"block_layer": 0, "block_expert": 0}
    for name in calls:
        real = getattr(ggml_experts, name)
        monkeypatch.setattr(ggml_experts, name, lambda *a, _real=real, _name=name, **kw: (
            calls.__setitem__(_name, calls[_name] + 1), _real(*a, **kw))[1])
    model.forward(torch.tensor([PROMPT]), model.new_cache(1, 64))
    assert calls == {"block_layer": len(model.moe_blocks()), "block_expert": 0}


@pytest.mark.skipif("avx512vnni" not in _cpu.supported_isas(), reason="the CPU lacks AVX-512 VNNI")
def test_fused_avx2_equals_avx512(gguf):
    model = _load(gguf)
    runs = []
    for isa in ("avx2", "avx512vnni"):
        with _cpu.forced_isa(isa):
            runs.append(_decode(model, True))
    assert torch.equal(*runs)


def test_the_block_head_in_the_kernel_call_has_its_bits(gguf):
    """The fused step computes the Q6_K lm_head (rounded input at q8) in its kernel call: the logits of the
    BlockLinear on the step's hidden state, bit for bit."""
    model = _load(gguf)
    inside = _decode(model, True)
    assert model._plan.logits
    head = model.lm_head
    model.lm_head = lambda h: head(h)  # not a BlockLinear: the plan leaves the head to the model
    try:
        apart = _decode(model, True)
        assert not model._plan.logits
    finally:
        model.lm_head = head
    assert torch.equal(inside, apart)
