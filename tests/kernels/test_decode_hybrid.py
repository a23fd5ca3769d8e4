"""The fused hybrid decode stack (kernels/decode_layers/hybrid_cpu.cpp, bound by engine/decode_plan.py):
KDA, Gated DeltaNet, absorbed MLA, gated GQA, attention residuals, latent MoE and shared experts for one
decode token in one call, against the op-by-op engine (its PyTorch reference), and its AVX2 build against
its AVX-512 build (Kimi K3, Kimi-Linear, Qwen3-Next; Kimi K2.5, DeepSeek-V3's layout: MLA rotating its rope part)."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu

from localmoe.config import EngineConfig
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import kv_cache_dtype

from .conftest import greedy_logits

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")

PROMPT = list(range(3, 73))  # 70 tokens: MLA attends over more than one 64-key block
STEPS = 10


@pytest.fixture(scope="module", params=["kimi_k3", "kimi_linear", "qwen3_next", "kimi_k25"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), size="tiny", seed=3)


def _load(path, dtype="float32", precision="exact"):
    return load_model(path, EngineConfig(dtype=dtype, max_context=128, expert_precision=precision),
                      progress=False).model


def _decode(model, planned: bool) -> torch.Tensor:
    """Logits [STEPS, V] of STEPS greedy decode steps after PROMPT; `planned`: through the decode plan."""
    return greedy_logits(model, PROMPT, STEPS, planned, 128)


@pytest.mark.parametrize("dtype,cache", [("float32", "float32"), ("bfloat16", "float32"), ("float32", "bfloat16"),
                                         ("float32", "fp8")])
def test_fused_matches_op_by_op(checkpoint, dtype, cache):
    """bf16 / fp8 latent and K/V caches (Qwen3-Next's GQA layers) are read and written in place as the engine does:
    every step runs fused."""
    model = _load(checkpoint, dtype)
    with kv_cache_dtype(model, cache):
        want = _decode(model, False)
        got = greedy_logits(model, PROMPT, STEPS, True, 128, every_step=True)
    scale = want.amax(-1) - want.amin(-1)
    err = ((got - want).abs().amax(-1) / scale).max().item()
    assert err < 1e-5, f"fused decode differs from op by op by {err:.2e} of the logit range"


def test_a_wrong_weight_is_seen(checkpoint):
    """The comparison can fail: one changed MLP norm weight moves the fused logits."""
    model = _load(checkpoint)
    want = _decode(model, True)
    model.layers[1][2][0] += 0.5
    assert not torch.allclose(_decode(model, True), want, rtol=0, atol=1e-3)


@pytest.mark.skipif("avx512vnni" not in _cpu.supported_isas(), reason="the CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_avx2_equals_avx512(checkpoint, precision):
    model = _load(checkpoint, precision=precision)
    runs = {}
    for isa in ("avx2", "avx512vnni"):
        with _cpu.forced_isa(isa):
            runs[isa] = _decode(model, True)
    assert torch.equal(runs["avx2"], runs["avx512vnni"])


@pytest.mark.skipif("avx512vnni" not in _cpu.supported_isas(), reason="the CPU lacks AVX-512 VNNI")
@pytest.mark.parametrize("cache", ["bfloat16", "fp8"])
def test_avx2_equals_avx512_over_lossy_caches(checkpoint, cache):
    model = _load(checkpoint)
    runs = {}
    with kv_cache_dtype(model, cache):
        for isa in ("avx2", "avx512vnni"):
            with _cpu.forced_isa(isa):
                runs[isa] = greedy_logits(model, PROMPT, STEPS, True, 128, every_step=True)
    assert torch.equal(runs["avx2"], runs["avx512vnni"])


class _Head:
    """The model's lm_head behind a type the plan does not take into its kernel call."""

    def __init__(self, head):
        self.head = head

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(h)


def test_the_head_in_the_kernel_call_has_the_linears_bits(checkpoint):
    """Where the plan computes the lm_head in its kernel call (`logits`), the logits are the model's Linear's on
    the plan's hidden state, bit for bit."""
    model = _load(checkpoint, precision="q8")
    inside = _decode(model, True)
    assert model._plan.logits
    head, model.lm_head = model.lm_head, _Head(model.lm_head)
    try:
        apart = _decode(model, True)
        assert not model._plan.logits
    finally:
        model.lm_head = head
    assert torch.equal(inside, apart)


def test_sequences_taking_turns_equal_each_alone(checkpoint, monkeypatch):
    """The plan sets a layer's cache pointers again only where the cache's tensors changed: two sequences'
    caches taking turns step by step, their latent caches reallocated on the way (16-token blocks: the pool
    grows past 80 positions), give each sequence's logits alone, bit for bit."""
    from localmoe.kernels.decode_layers.hybrid import HybridDecoder

    from localmoe.engine import cache as cache_module

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 16)
    calls, call = [], HybridDecoder.__call__
    monkeypatch.setattr(HybridDecoder, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    model = _load(checkpoint, precision="q8")
    prompts, steps = [PROMPT, PROMPT[::-1]], 14

    def run(caches: list, order: list[int]) -> list[list[torch.Tensor]]:
        logits = [model.forward(torch.tensor([p]), c)[:, -1] for p, c in zip(prompts, caches)]
        out = [[], []]
        for s in order:
            logits[s] = model.forward(logits[s].argmax(-1, keepdim=True), caches[s])[:, -1]
            out[s].append(logits[s][0])
        return out

    model._plan = None
    alone = [run([model.new_cache(1, 128), model.new_cache(1, 128)], [s] * steps)[s] for s in (0, 1)]
    turns = run([model.new_cache(1, 128), model.new_cache(1, 128)], [0, 1] * steps)
    assert model._plan.logits and len(calls) == 4 * steps, f"{len(calls)} of {4 * steps} steps ran fused"
    for s in (0, 1):
        assert torch.equal(torch.stack(turns[s]), torch.stack(alone[s])), f"sequence {s}"
