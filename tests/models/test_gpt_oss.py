"""gpt-oss on the tiny generated checkpoint (real layout: MXFP4 experts + biases, sinks,
sliding-window layers, YaRN) against transformers 5.23 `GptOssForCausalLM`, MXFP4
dequantised on CPU in fp32; plus cached decode, left-padded batches and expert providers."""

from __future__ import annotations

import math

import pytest
import torch

from localmoe.engine.experts import ResidentExperts
from localmoe.engine.rope import inverse_frequencies
from localmoe.testing.parity import (
    assert_chunked_prefill_and_decode_equal_full,
    assert_prefill_and_greedy_decode_match,
    load_pair,
    random_tokens,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    # the reference dequantises the MXFP4 experts to fp32; ours keeps them packed
    return load_pair(tiny_checkpoint("gpt_oss", tmp_path_factory), transformers.AutoModelForCausalLM,
                     quantization_config=transformers.Mxfp4Config(dequantize=True))


def test_spec_reads_the_gpt_oss_facts(models):
    ours, _ = models
    spec = ours.spec
    assert spec.layer_kinds == ("sliding_attention", "attention") * 2
    assert spec.sliding_window == 4 and spec.rope_scaling["truncate"] is False
    assert (spec.swiglu_limit, spec.swiglu_alpha, spec.scoring_func) == (7.0, 1.702, "topk_softmax")


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE)


def test_prefill_then_decode_equals_full_forward(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(24, 2, vocab)  # chunked prefill [:10], [10:17] crosses the window, then decode
    assert_chunked_prefill_and_decode_equal_full(model, tokens, (10, 17), 32, rtol=1e-5, atol=1e-5)


def test_q8_expert_precision_reaches_every_moe_layer(models, tmp_path_factory):
    """The default expert precision (q8: each expert projection's input rounded to int8 per 32 values;
    its arithmetic is checked in tests/kernels/test_mxfp4_moe_layer.py) is what every MoE layer runs,
    and it changes the logits. Not compared token by token here: on random tiny weights a rounding
    step can flip a top-k choice, and that flip moves later logits by far more than the rounding."""
    from localmoe.testing.parity import load_ours

    model = load_ours(tiny_checkpoint("gpt_oss", tmp_path_factory), expert_precision="q8").model
    assert {block.precision for block in model.moe_blocks()} == {"q8"}
    assert {block.precision for block in models[0].model.moe_blocks()} == {"exact"}
    tokens = random_tokens(24, 2, model.spec.vocab_size)
    exact = models[0].model.forward(tokens, models[0].model.new_cache(1, 32), all_logits=True)
    q8 = model.forward(tokens, model.new_cache(1, 32), all_logits=True)
    assert torch.isfinite(q8).all() and not torch.equal(q8, exact)


def test_fused_decode_step_equals_the_op_by_op_step(models):
    """Decode of one sequence runs each attention layer as one kernel call (kernels/gqa_decode
    step_kernel_for); with it switched off the layers run op by op: the logits agree, sliding window
    and sinks included, and the fused call really ran."""
    model, vocab = models[0].model, models[0].spec.vocab_size
    layers = [mixer for _, mixer, _, _ in model.layers]
    kernels = [layer.fused_step for layer in layers]
    assert all(k is not None for k in kernels)
    calls = []

    def counting(kernel):
        return lambda *args: calls.append(1) or kernel(*args)

    prompt = random_tokens(7, 5, vocab)

    def run() -> torch.Tensor:
        cache = model.new_cache(1, 32)
        out = [model.forward(prompt, cache)]
        out += [model.forward(torch.tensor([[3 + t]]), cache) for t in range(8)]
        return torch.cat(out, dim=1)

    try:
        for layer, kernel in zip(layers, kernels):
            layer.fused_step = counting(kernel)
        fused = run()
        for layer in layers:
            layer.fused_step = None
        op_by_op = run()
    finally:
        for layer, kernel in zip(layers, kernels):
            layer.fused_step = kernel
    assert len(calls) == 8 * len(layers)
    torch.testing.assert_close(fused, op_by_op, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_decode_plan_gives_the_op_by_op_bits(precision, tmp_path_factory, monkeypatch):
    """Single-sequence decode runs the whole layer stack as one kernel call (engine/decode_plan.py); it
    calls the same kernels in the same order as the op-by-op step, so the logits are the same bits,
    across a sliding window's edge and a cache block boundary."""
    from localmoe.engine import cache as cache_module
    from localmoe.engine.decode_plan import DecodePlan
    from localmoe.testing.parity import load_ours

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)  # the pools grow (move) during the run
    model = load_ours(tiny_checkpoint("gpt_oss", tmp_path_factory), expert_precision=precision).model
    prompt = random_tokens(5, 6, model.spec.vocab_size)

    def run() -> list[torch.Tensor]:
        cache = model.new_cache(1, 40)
        out = [model.forward(prompt, cache)]
        return out + [model.forward(torch.tensor([[3 + 2 * t]]), cache) for t in range(14)]

    from localmoe.kernels.decode_layers import GqaMoeDecoder

    calls, call = [], GqaMoeDecoder.__call__
    monkeypatch.setattr(GqaMoeDecoder, "__call__", lambda self, *args: calls.append(1) or call(self, *args))
    planned = run()
    assert isinstance(model._plan, DecodePlan) and len(calls) == 14
    monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, m: None))
    model._plan = None
    op_by_op = run()
    assert all(torch.equal(a, b) for a, b in zip(planned, op_by_op))


def test_left_padded_batch_equals_single_runs(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    long, short = random_tokens(13, 3, vocab)[0], random_tokens(6, 4, vocab)[0]  # window 4 < both lengths
    pad = len(long) - len(short)
    batch = torch.stack([long, torch.cat([torch.zeros(pad, dtype=torch.long), short])])
    mask = torch.ones_like(batch, dtype=torch.bool)
    mask[1, :pad] = False
    cache = model.new_cache(2, 24)
    first = model.forward(batch, cache, mask=mask)
    steps = [first] + [model.forward(torch.tensor([[5 + t], [9 + t]]), cache) for t in range(5)]
    for row, seq, nxt in ((0, long, 5), (1, short, 9)):
        single_cache = model.new_cache(1, 24)
        expected = [model.forward(seq[None], single_cache)]
        expected += [model.forward(torch.tensor([[nxt + t]]), single_cache) for t in range(5)]
        for got, exp in zip(steps, expected):
            torch.testing.assert_close(got[row:row + 1], exp, rtol=1e-5, atol=1e-5)


def test_experts_stay_mxfp4_bytes_and_come_through_the_provider(models):
    model, spec = models[0].model, models[0].spec
    blocks = model.moe_blocks()
    assert len(blocks) == spec.num_layers
    expert = blocks[1].experts.get(1, 3)
    assert expert.gate.packed.dtype == torch.uint8 and expert.gate.weight is None
    assert expert.gate.packed.shape == (spec.moe_intermediate_size, spec.hidden_size // 2)
    assert expert.down.scales.shape == (spec.hidden_size, spec.moe_intermediate_size // 32)
    dense_experts = spec.num_layers * spec.num_experts * 3 * spec.hidden_size * spec.moe_intermediate_size * 4
    resident = sum(b.experts.nbytes() for b in blocks)
    assert resident < dense_experts / 6  # ~4.25 bits per weight (+ biases), never a float copy

    class Counting:  # a provider wrapper, as a pager would sit behind the same interface
        def __init__(self, inner):
            self.inner, self.calls = inner, []

        def get(self, layer, e):
            self.calls.append((layer, e))
            return self.inner.get(layer, e)

        def nbytes(self):
            return self.inner.nbytes()

    tokens = random_tokens(9, 5, spec.vocab_size)
    before = model.forward(tokens, model.new_cache(1, 16), all_logits=True)
    merged = ResidentExperts({})
    for b in blocks:
        merged.merge(b.experts)
    counting = Counting(merged)
    originals = [b.experts for b in blocks]
    try:
        model.use_experts(counting)
        after = model.forward(tokens, model.new_cache(1, 16), all_logits=True)
    finally:
        for b, provider in zip(blocks, originals):
            b.experts = provider
    assert torch.equal(before, after)
    layers = {layer for layer, _ in counting.calls}
    assert layers == set(range(spec.num_layers))
    per_layer = [sum(1 for layer, _ in counting.calls if layer == i) for i in layers]
    assert all(n <= spec.num_experts for n in per_layer)  # each chosen expert fetched once per call


@pytest.mark.parametrize("truncate", [False, True])
def test_yarn_frequencies_match_transformers(truncate):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
               "original_max_position_embeddings": 4096, "truncate": truncate}
    config = transformers.GptOssConfig(head_dim=64, num_attention_heads=4, hidden_size=256,
                                       rope_parameters={**scaling, "rope_theta": 150000.0})
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    ours, mscale = inverse_frequencies(64, 150000.0, scaling)
    torch.testing.assert_close(ours.float(), expected, rtol=1e-5, atol=0)
    assert math.isclose(mscale, factor, rel_tol=1e-12)


def test_experts_from_the_packed_store_give_bit_identical_logits(models, tmp_path):
    """A provider over `PackedStore.expert` extents (what the pager will read) needs no
    conversion step: `ExpertWeights.from_parts` takes the extent's parts as they are."""
    from localmoe.convert import convert
    from localmoe.engine.experts import ExpertWeights
    from localmoe.store.packed import PackedStore

    ours, _ = models
    model = ours.model
    convert(ours.source, tmp_path / "store")

    class StoreExperts:
        def __init__(self, store):
            self.store = store

        def get(self, layer, expert):
            return ExpertWeights.from_parts(self.store.expert(layer, expert, verify=True))

        def nbytes(self):
            return 0

    tokens = random_tokens(11, 6, ours.spec.vocab_size)
    before = model.forward(tokens, model.new_cache(1, 16), all_logits=True)
    originals = [b.experts for b in model.moe_blocks()]
    with PackedStore(tmp_path / "store") as store:
        try:
            model.use_experts(StoreExperts(store))
            after = model.forward(tokens, model.new_cache(1, 16), all_logits=True)
        finally:
            for b, provider in zip(model.moe_blocks(), originals):
                b.experts = provider
    assert torch.equal(before, after)
