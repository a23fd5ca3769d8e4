"""Kimi-Linear on the tiny generated checkpoint (KDA layers, one NoPE MLA layer, a dense first
layer, sigmoid-routed MoE with correction bias, renormalisation, routed_scaling_factor 2.446
and a shared expert) against transformers 5.23 `KimiLinearForCausalLM` in fp32; plus cached
decode against a full forward."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers.moe import MoEBlock
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
# through the registry: importing localmoe.models.kimi_linear first would register only that family
HF_TENSORS = family_for_model_type("kimi_linear").hf_tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return load_pair(tiny_checkpoint("kimi_linear", tmp_path_factory), transformers.AutoModelForCausalLM)


def test_spec_reads_the_kimi_linear_facts(models):
    spec = models[0].spec
    assert spec.layer_kinds == ("kda", "kda", "kda", "mla")  # full_attn_layers [4] is 1-indexed
    assert spec.mlp_kinds == ("dense", "moe", "moe", "moe")
    assert (spec.scoring_func, spec.norm_topk_prob, spec.routed_scaling_factor) == ("sigmoid", True, 2.446)
    assert (spec.n_group, spec.topk_group, spec.expert_act, spec.num_shared_experts) == (1, 1, "swiglu", 1)


def test_block_sparse_moe_names_are_renamed_to_the_canonical_mlp():
    assert HF_TENSORS.resolve("model.layers.2.block_sparse_moe.gate.weight")[0] == "layers.2.mlp.router.weight"
    assert HF_TENSORS.resolve("model.layers.1.block_sparse_moe.gate.e_score_correction_bias")[0] == \
        "layers.1.mlp.router.e_score_correction_bias"
    for src, dst in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
        name = f"model.layers.3.block_sparse_moe.experts.17.{src}.weight"
        assert HF_TENSORS.resolve(name)[0] == f"layers.3.mlp.experts.17.{dst}.weight"
    assert HF_TENSORS.resolve("model.layers.1.block_sparse_moe.shared_experts.down_proj.weight")[0] == \
        "layers.1.mlp.shared_experts.down_proj.weight"
    with pytest.raises(KeyError):
        HF_TENSORS.resolve("model.layers.1.block_sparse_moe.experts.0.w4.weight")


def test_router_correction_bias_and_shared_experts_are_loaded(models):
    ours, reference = models
    blocks = ours.model.moe_blocks()
    assert len(blocks) == 3 and all(isinstance(b, MoEBlock) and b.shared is not None for b in blocks)
    for block in blocks:
        bias = reference.model.layers[block.layer].mlp.gate.e_score_correction_bias
        assert bias.abs().max() > 0  # the generated bias is random, so selection really is biased
        torch.testing.assert_close(block.router.correction_bias, bias.float(), rtol=0, atol=0)


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE)


def test_prefill_then_decode_equals_full_forward(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(80, 2, vocab)  # > one 64-token KDA chunk
    # chunked form [:37], then a second prefill [37:70], then the recurrent form one token at a time
    assert_chunked_prefill_and_decode_equal_full(model, tokens, (37, 70), 96, rtol=1e-4, atol=1e-5)


def test_batch_of_two_equals_single_runs(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    assert_batch_equals_single(model, random_tokens(20, 3, vocab, batch=2), 24, rtol=1e-4, atol=1e-5)
