"""Qwen3-Next on the tiny generated checkpoint (Gated DeltaNet layers with 2 key / 4 value
heads, one gated full-attention layer with partial RoPE, softmax-routed MoE with a
sigmoid-gated shared expert, `(1 + w)` RMSNorms) against transformers 5.23
`Qwen3NextForCausalLM` in fp32; plus cached decode against a full forward and batching."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers.gated_deltanet import GatedDeltaNet
from localmoe.models import family_for_model_type
from localmoe.testing.parity import (
    assert_batch_equals_single,
    assert_chunked_prefill_and_decode_equal_full,
    assert_prefill_and_greedy_decode_match,
    load_pair,
    random_tokens,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16
HF_TENSORS = family_for_model_type("qwen3_next").hf_tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair(tiny_checkpoint("qwen3_next", tmp_path_factory), transformers.AutoModelForCausalLM)


def test_spec_reads_the_qwen3_next_facts(models):
    spec = models[0].spec
    assert spec.layer_kinds == ("gated_delta", "gated_delta", "gated_delta", "attention")  # interval 4
    assert (spec.gated_delta.num_key_heads, spec.gated_delta.num_value_heads) == (2, 4)  # grouped: 2 value heads per key head
    assert (spec.partial_rotary_factor, spec.attn_output_gate, spec.norm_topk_prob) == (0.25, True, True)
    assert isinstance(models[0].model.layers[0][1], GatedDeltaNet)


def test_zero_centred_norms_get_one_added_and_the_gdn_norm_does_not(models):
    ours, reference = models
    layer_norm, _, _, _ = ours.model.layers[3]
    hf = reference.model.layers[3]
    torch.testing.assert_close(layer_norm, hf.input_layernorm.weight.float() + 1, rtol=0, atol=0)
    torch.testing.assert_close(ours.model.norm, reference.model.norm.weight.float() + 1, rtol=0, atol=0)
    gdn = ours.model.layers[0][1]
    torch.testing.assert_close(gdn.norm, reference.model.layers[0].linear_attn.norm.weight.float(), rtol=0, atol=0)


def test_router_and_shared_expert_names_are_renamed():
    assert HF_TENSORS.resolve("model.layers.2.mlp.gate.weight")[0] == "layers.2.mlp.router.weight"
    assert HF_TENSORS.resolve("model.layers.2.mlp.experts.5.up_proj.weight")[0] == "layers.2.mlp.experts.5.up.weight"
    assert HF_TENSORS.resolve("model.layers.1.mlp.shared_expert.down_proj.weight")[0] == \
        "layers.1.mlp.shared_experts.down_proj.weight"
    assert HF_TENSORS.resolve("model.layers.1.mlp.shared_expert_gate.weight")[0] == \
        "layers.1.mlp.shared_expert_gate.weight"
    with pytest.raises(KeyError):
        HF_TENSORS.resolve("model.layers.1.linear_attn.in_proj_xyz.weight")


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE)


def test_prefill_then_decode_equals_full_forward(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(50, 2, vocab)
    assert_chunked_prefill_and_decode_equal_full(model, tokens, (23, 41), 64, rtol=1e-4, atol=1e-5)


def test_batch_of_two_equals_single_runs(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    assert_batch_equals_single(model, random_tokens(20, 3, vocab, batch=2), 24, rtol=1e-4, atol=1e-5)
