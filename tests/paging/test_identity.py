"""Invariant: paged generation is bit-identical to fully resident generation."""

from __future__ import annotations

import pytest
import torch

from localmoe.paging import PagingConfig, attach, expert_bytes, make_pager
from localmoe.paging.trace import RoutingTrace

from .conftest import run_greedy

POLICIES = ["lru", "lfu", "lfru", "belady"]


def _record_trace(c) -> str:
    trace = RoutingTrace()
    attach(c.model, trace=trace)
    run_greedy(c.model)
    c.restore()
    path = c.store_path.parent / f"{c.family}-trace.json"
    trace.save(path)
    return str(path)


def _slot_budgets(store):
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    layers = len(store.layers())
    total = expert_bytes(store) // slot
    return {"1-slot": slot, "1-per-layer": layers * slot, "25%": max(1, total // 4) * slot, "all": total * slot}


def _paged_run(c, budget, policy, io, prefetch, depth=1):
    store = c.store()
    trace = _record_trace(c) if policy == "belady" else ""
    pager = make_pager(store, PagingConfig(ram_budget=budget, policy=policy, io=io, prefetch=prefetch,
                                           trace=trace, timeout=10))
    c.model.use_experts(pager)
    attach(c.model, pager, lookahead=prefetch, depth=depth)
    try:
        tokens, logits = run_greedy(c.model)
    finally:
        pager.close()
        c.restore()
    return tokens, logits, pager


def _assert_identical(c, tokens, logits):
    assert tokens == c.tokens
    assert len(logits) == len(c.logits)
    for step, (a, b) in enumerate(zip(logits, c.logits)):
        assert torch.equal(a, b), f"logits differ at step {step}: max {(a - b).abs().max().item():.3e}"


@pytest.mark.parametrize("io", ["odirect", "mmap"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("budget", ["1-slot", "1-per-layer", "25%", "all"])
def test_gpt_oss_bit_identical(gpt_oss, budget, policy, io):
    prefetch = budget != "1-slot" or policy == "lru"  # with one slot, prefetch is (correctly) a no-op
    b = _slot_budgets(gpt_oss.store())[budget]
    tokens, logits, pager = _paged_run(gpt_oss, b, policy, io, prefetch)
    _assert_identical(gpt_oss, tokens, logits)
    ram = pager.stats.ram
    assert ram.misses > 0 and ram.bytes_read == ram.loads * pager.slab.slot_bytes
    if budget == "all" and policy == "belady":
        # every expert read at most once when all fit
        assert ram.loads <= len(pager.store.layers()) * len(pager.store.experts_in(pager.store.layers()[0]))


@pytest.mark.parametrize("prefetch", [False, True])
@pytest.mark.parametrize("policy", POLICIES)
def test_kimi_linear_bit_identical(kimi_linear, policy, prefetch):
    b = _slot_budgets(kimi_linear.store())["1-per-layer"]
    tokens, logits, _ = _paged_run(kimi_linear, b, policy, "odirect", prefetch)
    _assert_identical(kimi_linear, tokens, logits)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("policy", ["lru", "lfru"])
def test_kimi_k3_bit_identical(kimi_k3, policy, depth):
    """Resident decode routes and runs the MXFP4 experts inside the fused hybrid kernel; paged decode runs the
    same kernel with the experts called back through the pager: the same bits (guessing one or two MoE layers
    ahead)."""
    assert type(kimi_k3.model._plan.decoder).__name__ == "HybridDecoder"
    b = _slot_budgets(kimi_k3.store())["1-per-layer" if depth == 1 else "25%"]
    tokens, logits, pager = _paged_run(kimi_k3, b, policy, "odirect", True, depth)
    _assert_identical(kimi_k3, tokens, logits)
    assert pager.stats.prefetch.issued > 0
    assert any(isinstance(rank, tuple) for rank in pager._ranks) == (depth == 2)  # guesses two layers ahead read
    # the later layers' routers making one token's guesses are the pager's work on the compute thread: in lookup
    assert 0 < pager.stats.prefetch.hint_seconds <= pager.stats.ram.lookup_seconds


def test_resident_differs_when_an_expert_differs(gpt_oss):
    """The comparison can fail: a pager serving one wrong expert changes the logits."""
    store = gpt_oss.store()
    pager = make_pager(store, PagingConfig(ram_budget=_slot_budgets(store)["all"], prefetch=False))
    real_get = pager.get

    def wrong(layer, expert):
        return real_get(layer, (expert + 1) % gpt_oss.loaded.spec.num_experts if layer == 1 else expert)

    pager.get = wrong
    gpt_oss.model.use_experts(pager)
    try:
        _, logits = run_greedy(gpt_oss.model)
    finally:
        pager.close()
    assert not all(torch.equal(a, b) for a, b in zip(logits, gpt_oss.logits))


@pytest.mark.parametrize("budget", ["1-slot", "25%", "all"])
def test_kimi_k3_paged_layer_in_one_kernel_call(kimi_k3, budget, monkeypatch):
    """Where the slab holds a layer's chosen experts together (`Pager.hold`), the fused step's callback runs them
    in one MoE kernel call over a table of their slots (HeldTable); with one slot, one expert at a time; with every
    expert in the slab, the layers run whole in the fused step, routing included (`Pager.load_all`). Every way
    paged decode equals resident decode bit for bit."""
    from localmoe.kernels.mxfp4_moe.held import HeldTable

    filled = []
    fill = HeldTable.fill

    def counted(self, experts):
        filled.append(fill(self, experts))
        return filled[-1]

    monkeypatch.setattr(HeldTable, "fill", counted)
    b = _slot_budgets(kimi_k3.store())[budget]
    tokens, logits, pager = _paged_run(kimi_k3, b, "lfru", "odirect", budget != "1-slot")
    _assert_identical(kimi_k3, tokens, logits)
    moe_layers = len(kimi_k3.model.moe_blocks())
    if budget == "25%":
        assert len(filled) >= (len(tokens) - 1) * moe_layers and all(filled)
        assert pager.stats.ram.hits + pager.stats.ram.misses > 0
    else:  # one slot: one expert at a time; every expert: the layers run whole (test_pager), no callback
        assert filled == []


@pytest.mark.parametrize("budget", ["25%", "1-per-layer"])
def test_kimi_linear_dense_experts_paged_in_one_call(kimi_linear, budget, monkeypatch):
    """Dense (bf16) experts held together run in one call over a held table of their slots (HeldDenseTable through
    `dense_experts_token`, the loop the fused step runs over a resident dense layer), never one `dense_expert`
    call each from the callback: paged equals resident bit for bit."""
    from localmoe.kernels.decode_layers import hybrid
    from localmoe.kernels.mxfp4_moe.held import HeldDenseTable

    assert type(kimi_linear.model._plan.decoder).__name__ == "HybridDecoder"
    filled, single = [], []
    fill = HeldDenseTable.fill

    def counted(self, experts):
        filled.append(fill(self, experts))
        return filled[-1]

    monkeypatch.setattr(HeldDenseTable, "fill", counted)
    monkeypatch.setattr(hybrid, "dense_expert", lambda *a, _real=hybrid.dense_expert: (single.append(1), _real(*a)))
    b = _slot_budgets(kimi_linear.store())[budget]
    tokens, logits, pager = _paged_run(kimi_linear, b, "lfru", "odirect", True)
    _assert_identical(kimi_linear, tokens, logits)
    assert len(filled) >= len(tokens) * len(kimi_linear.model.moe_blocks()) and all(filled)
    assert single == [] and pager.stats.ram.misses > 0


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
def test_store_without_a_budget_runs_its_layers_whole(ckpts, family, monkeypatch):
    """A store loaded without --ram (StoreExperts: the store's maps, the page cache decides) hands each layer's
    experts to the kernels whole, routing inside the fused step's call as a resident model does, never through
    the experts callback one expert at a time: the resident bits."""
    from localmoe.config import EngineConfig
    from localmoe.engine.experts import ExpertWeights
    from localmoe.load import load_model
    from localmoe.paging import StoreExperts

    c = ckpts[family]
    model = load_model(c.store_path, EngineConfig(dtype="float32", threads=1), progress=False).model
    provider = model.moe_blocks()[0].experts
    assert isinstance(provider, StoreExperts)
    built = []
    monkeypatch.setattr(ExpertWeights, "from_parts", classmethod(
        lambda cls, parts, _real=ExpertWeights.from_parts.__func__: (built.append(1), _real(cls, parts))[1]))
    tokens, logits = run_greedy(model)
    _assert_identical(c, tokens, logits)
    assert all((provider.kernel_table(b.layer) or provider.dense_table(b.layer)) is not None
               for b in model.moe_blocks())
    experts = sum(len(c.store().experts_in(b.layer)) for b in model.moe_blocks())
    assert len(built) == experts  # each expert mapped once, with its layer
    run_greedy(model)
    assert len(built) == experts  # and never again
