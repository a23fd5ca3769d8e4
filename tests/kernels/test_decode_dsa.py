"""DSA layers in the fused hybrid decode step (kernels/decode_layers/hybrid_mixers.h `Indexer`, bound by
engine/decode_plan.py): the lightning indexer (index key into the DSA cache, index queries and head weights,
relu scores, top-k with kernels/topk_select's tie rule) and the sparse absorbed MLA over the chosen rows, for
DeepSeek-V3.2, GLM-5 (whose dsa_shared layers reuse the latest selection) and GLM-5-Next (the k-pool indexer
beside KDA layers, inside hyper-connections: hybrid_cpu.cpp `hc_weights`), against the op-by-op engine.

The tiny models' index_topk (4) is below every decode context here, so each step selects, and from a short
prompt many relu-zero scores tie: the tie order decides the chosen rows (`test_the_tie_order_is_seen`)."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu
from localmoe.kernels.topk_select import reference as topk_reference

from localmoe.config import EngineConfig
from localmoe.engine import decode_plan
from localmoe.engine.layers import index_cache
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import kv_cache_dtype

from .conftest import greedy_logits

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")

STEPS = 16
SHORT, LONG = list(range(3, 8)), list(range(3, 73))  # 5 tokens: ties at relu zero; 70: past a 64-key block


@pytest.fixture(scope="module", params=["deepseek_v32", "glm_moe_dsa", "glm5_next"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), size="tiny", seed=3)


def _load(path, dtype="float32", precision="exact"):
    return load_model(path, EngineConfig(dtype=dtype, max_context=128, expert_precision=precision),
                      progress=False).model


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference over the steps, as a fraction of each step's logit range."""
    return ((got - want).abs().amax(-1) / (want.amax(-1) - want.amin(-1))).max().item()


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
@pytest.mark.parametrize("dtype,cache", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16"),
                                         ("float32", "fp8")])
def test_fused_matches_op_by_op(checkpoint, dtype, cache, prompt):
    """Every step fused; with a bf16 / fp8 cache the kernel writes the engine's rounded rows and reads them back
    as the engine does (tests/kernels/test_cache_rows.py), so only the order of operations differs."""
    model = _load(checkpoint, dtype)
    assert model.spec.dsa.index_topk < len(prompt) or prompt is SHORT
    with kv_cache_dtype(model, cache):
        want = greedy_logits(model, prompt, STEPS, False, 128)
        got = greedy_logits(model, prompt, STEPS, True, 128, every_step=True)
    assert any(c.mla.dsa.select for c in model._plan.decoder.layers)
    assert bool(model._plan.decoder.layers[0].hc_mult) == (model.spec.hyper_connections is not None)
    assert _error(got, want) < 1e-5, f"fused decode differs from op by op by {_error(got, want):.2e}"


def test_the_cache_rounding_is_seen(checkpoint):
    """Op by op over an fp8 cache is far from op by op over an fp32 one (rows older than the exact ring are
    read rounded), so the fp8 case above checks the kernel's rounding and reading."""
    model = _load(checkpoint)
    want = greedy_logits(model, LONG, STEPS, False, 128)
    with kv_cache_dtype(model, "fp8"):
        assert _error(greedy_logits(model, LONG, STEPS, False, 128), want) > 1e-3


def test_kept_pools_change_nothing(checkpoint, monkeypatch):
    """GLM-5-Next's complete pools' keys are kept (index_cache.KeptPools): op by op and fused give the bits of
    recomputing every pool each step, and op by op pools only the newest tokens once a decode step runs."""
    from localmoe.engine.layers import kpool_indexer

    model = _load(checkpoint)
    if not model.spec.dsa.index_kpool:
        pytest.skip("no k-pool indexer")
    kept = {path: greedy_logits(model, LONG, STEPS, path, 128, every_step=path) for path in (False, True)}
    pooled, seen = kpool_indexer.pool_keys, []
    monkeypatch.setattr(kpool_indexer, "pool_keys", lambda keys, *a: seen.append(keys.shape[1]) or pooled(keys, *a))
    greedy_logits(model, LONG, STEPS, False, 128)
    assert max(seen[1:]) < 2 * model.spec.dsa.index_kpool  # after the prompt: the open pool's tokens only
    monkeypatch.setattr(kpool_indexer.KPoolIndexer, "pooled",
                        lambda self, cached, valid, step, kept=None: pooled(
                            cached[..., :self.head_dim], cached[..., self.head_dim:], self.ape, valid, False))
    room = index_cache.KeptPools.fused_room

    def again(self, pools):  # the kernel pools everything again
        self.fused_done.zero_()
        return room(self, pools)

    monkeypatch.setattr(index_cache.KeptPools, "fused_room", again)
    for path in (False, True):
        assert torch.equal(greedy_logits(model, LONG, STEPS, path, 128), kept[path])


def test_the_tie_order_is_seen(checkpoint, monkeypatch):
    """Op by op with the opposite tie order (the later of equal scores) is far from the fused step: the
    comparison above sees which tied rows the C++ top-k keeps. (GLM-5-Next's tiny pools never tie at the k-th
    place in these runs: its k-pool selection shares `top_rows` and `top_columns` with the others.)"""
    model = _load(checkpoint)
    if model.spec.dsa.index_kpool:
        pytest.skip("no tie at the k-th pool in this run")
    fused = greedy_logits(model, SHORT, STEPS, True, 128)
    earliest = topk_reference.top_columns

    def latest(scores, k):
        columns, kept = earliest(scores.flip(-1), k)
        return (scores.shape[-1] - 1 - columns).flip(-1), kept.flip(-1)

    monkeypatch.setattr(topk_reference, "top_columns", latest)
    assert _error(fused, greedy_logits(model, SHORT, STEPS, False, 128)) > 1e-2


@pytest.mark.parametrize("field,change", [("top_k", lambda v: v - 1), ("weight_scale", lambda v: -v),
                                          ("hc_eps", lambda v: 0.1)])
def test_a_wrong_top_k_scale_or_mix_is_seen(checkpoint, monkeypatch, field, change):
    model = _load(checkpoint)
    if field.startswith("hc") and model.spec.hyper_connections is None:
        pytest.skip("no hyper-connections")
    want = greedy_logits(model, SHORT, STEPS, False, 128)
    build = decode_plan.DecodePlan.build

    def wrong(model):
        plan = build(model)
        for layer in plan.decoder.layers:
            if field.startswith("hc"):
                setattr(layer, field, change(getattr(layer, field)))
            elif layer.mla.dsa.select == 1:
                setattr(layer.mla.dsa, field, change(getattr(layer.mla.dsa, field)))
        return plan

    monkeypatch.setattr(decode_plan.DecodePlan, "build", wrong)
    assert _error(greedy_logits(model, SHORT, STEPS, True, 128), want) > 1e-2


@pytest.mark.skipif("avx512vnni" not in _cpu.supported_isas(), reason="the CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("precision,cache", [("exact", "float32"), ("q8", "float32"), ("exact", "fp8"),
                                             ("exact", "bfloat16")])
def test_avx2_equals_avx512(checkpoint, precision, cache):
    model = _load(checkpoint, precision=precision)
    runs = {}
    for isa in ("avx2", "avx512vnni"):
        with _cpu.forced_isa(isa), kv_cache_dtype(model, cache):
            runs[isa] = greedy_logits(model, LONG, STEPS, True, 128, every_step=True)
    assert torch.equal(runs["avx2"], runs["avx512vnni"])


def test_paged_equals_resident(checkpoint, tmp_path):
    """Experts through a pager with one layer's worth of slots (called back from the fused step) give the
    resident fused step's bits."""
    from localmoe.convert import convert
    from localmoe.paging import PagingConfig, attach, detach, make_pager
    from localmoe.store.packed import PackedStore

    model = _load(checkpoint)
    want = greedy_logits(model, LONG, STEPS, True, 128)
    convert(checkpoint, tmp_path / "store.lmoe", experts="keep")
    store = PackedStore(tmp_path / "store.lmoe")
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    pager = make_pager(store, PagingConfig(ram_budget=4 * slot, policy="lfru", timeout=10))
    model.use_experts(pager)
    attach(model, pager)
    try:
        got = greedy_logits(model, LONG, STEPS, True, 128)
    finally:
        detach(model)
        pager.close()
    assert pager.stats.ram.misses > 0
    assert torch.equal(got, want)


@pytest.mark.parametrize("family", ["deepseek_v32", "glm5_next"])
def test_wide_index_keys_and_many_streams(family, tmp_path, monkeypatch):
    """index_head_dim 256 (keys over two fp8-scale blocks of the index cache; k-pool: keys and gate logits over
    four) and, for GLM-5-Next, 18 hyper-connection streams: the fused step takes them (before: op by op past
    128 and 16), within 1e-5 of op by op over fp32 and fp8 caches."""
    import importlib

    sizes = importlib.import_module(f"localmoe.testing.families.{family}").SIZES
    monkeypatch.setitem(sizes, "tiny", dict(sizes["tiny"], index_dim=256, **({"hc": 18} if family == "glm5_next"
                                                                                else {})))
    model = _load(write_checkpoint(family, tmp_path, size="tiny", seed=3))
    assert model.spec.dsa.index_head_dim == 256
    for cache in ("float32", "fp8"):
        with kv_cache_dtype(model, cache):
            want = greedy_logits(model, LONG, STEPS, False, 128)
            got = greedy_logits(model, LONG, STEPS, True, 128, every_step=True)
        assert _error(got, want) < 1e-5, f"{cache}: fused decode differs from op by op by {_error(got, want):.2e}"
    assert model._plan.decoder.layers[0].hc_mult == (18 if family == "glm5_next" else 0)
