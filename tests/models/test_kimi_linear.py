"""Kimi-Linear on the tiny generated checkpoint (KDA layers, one NoPE MLA layer, a dense first
layer, sigmoid-routed MoE with correction bias, renormalisation, routed_scaling_factor 2.446
and a shared expert) against transformers 5.23 `KimiLinearForCausalLM` in fp32; plus cached
decode against a full forward."""

from __future__ import annotations

import warnings

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.moe import MoEBlock
from localmoe.load import load_model
from localmoe.models import family_for_model_type
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import assert_prefill_and_greedy_decode_match, random_tokens

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16
# through the registry: importing localmoe.models.kimi_linear first would register only that family
HF_TENSORS = family_for_model_type("kimi_linear").hf_tensors


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    path = write_checkpoint("kimi_linear", tmp_path_factory.mktemp("kimi_linear"), "tiny", seed=0)
    ours = load_model(path, EngineConfig(dtype="float32", threads=1), progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return ours, reference


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
    full = model.forward(tokens, model.new_cache(1, 96), all_logits=True)
    cache = model.new_cache(1, 96)
    parts = [model.forward(tokens[:, :37], cache, all_logits=True),  # chunked form, then a second prefill
             model.forward(tokens[:, 37:70], cache, all_logits=True)]
    parts += [model.forward(tokens[:, t:t + 1], cache) for t in range(70, 80)]  # recurrent form
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-4, atol=1e-5)


def test_batch_of_two_equals_single_runs(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    batch = random_tokens(20, 3, vocab, batch=2)
    both = model.forward(batch, model.new_cache(2, 24), all_logits=True)
    for row in range(2):
        single = model.forward(batch[row:row + 1], model.new_cache(1, 24), all_logits=True)
        torch.testing.assert_close(both[row:row + 1], single, rtol=1e-4, atol=1e-5)
