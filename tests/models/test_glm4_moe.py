"""GLM-4.5 (`glm4_moe`) against transformers 5.23 `Glm4MoeForCausalLM` in fp32: the generated tiny
checkpoint in the Hub layout (q/k/v biases, q/k norms, partial RoPE, a dense first layer, sigmoid-routed
MoE with correction bias and a shared expert, the appended MTP layer transformers skips), and a config
transformers itself saved without q/k norms and with the default partial RoPE; the packed store."""

from __future__ import annotations

import pytest
import torch

from localmoe.errors import CheckpointError
from localmoe.load import load_model
from localmoe.testing.families.glm5_next import TOKENIZER
from localmoe.testing.parity import (
    assert_batch_equals_single,
    assert_chunked_prefill_and_decode_equal_full,
    assert_prefill_and_greedy_decode_match,
    copy_with_config,
    load_ours,
    load_pair,
    random_tokens,
    tiny_checkpoint,
)
from localmoe.testing.tokenizer import VOCAB_SIZE, write_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    return tiny_checkpoint("glm4_moe", tmp_path_factory)


@pytest.fixture(scope="module")
def models(source):
    return load_pair(source, transformers.AutoModelForCausalLM)


def test_spec_reads_the_glm_facts(models):
    spec = models[0].spec
    assert spec.mlp_kinds == ("dense", "moe", "moe") and spec.nextn_layers == 1
    assert (spec.partial_rotary_factor, spec.attention_bias, spec.qk_norm) == (0.5, True, True)
    assert (spec.scoring_func, spec.norm_topk_prob, spec.routed_scaling_factor, spec.num_shared_experts) == \
        ("sigmoid", True, 2.5, 1)


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    assert_prefill_and_greedy_decode_match(ours.model, reference, random_tokens(48, 1, ours.spec.vocab_size), 12)


def test_prefill_then_decode_equals_full_forward_and_batch_equals_single(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    assert_chunked_prefill_and_decode_equal_full(model, random_tokens(40, 2, vocab), (17, 31), 48, rtol=1e-4, atol=1e-5)
    assert_batch_equals_single(model, random_tokens(16, 3, vocab, batch=2), 20, rtol=1e-4, atol=1e-5)


def test_a_checkpoint_without_the_mtp_count_names_the_extra_layer(source, tmp_path):
    """The MTP layer's tensors are skipped only because the config declares it: without
    `num_nextn_predict_layers` they are named as unused."""
    copy = copy_with_config(source, tmp_path / "no_mtp", lambda c: c.pop("num_nextn_predict_layers"))
    with pytest.raises(CheckpointError, match=r"layers\.3\."):
        load_ours(copy)


@pytest.fixture(scope="module")
def saved_by_transformers(tmp_path_factory):
    """No q/k norms (GLM-4.5-Air), partial_rotary_factor left to transformers' default, two groups."""
    config = transformers.Glm4MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        attention_bias=True, use_qk_norm=False, max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1, biases at 0: make them matter
        for name, p in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
        for layer in reference.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("glm4_moe_saved")
    reference.save_pretrained(path)
    write_tokenizer(path, TOKENIZER, 256)
    return reference, path


def test_a_checkpoint_transformers_saved_matches_it(saved_by_transformers):
    reference, path = saved_by_transformers
    ours = load_ours(path)
    assert (ours.spec.partial_rotary_factor, ours.spec.qk_norm, ours.spec.n_group) == (0.5, False, 2)
    assert_prefill_and_greedy_decode_match(ours.model, reference, random_tokens(40, 4, VOCAB_SIZE), 8)


def test_packed_store_pages_the_experts(source, tmp_path):
    """`convert` finds every routed expert (the MTP layer's stay out of the model); paged at a 1 MB budget the
    store gives the directory's logits (same fp32 weights: float noise only)."""
    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.convert import convert

    convert(source, tmp_path / "store", experts="keep", progress=False)
    direct = load_ours(source).model
    paged = load_model(tmp_path / "store", EngineConfig(dtype="float32", expert_precision="exact", threads=1,
                                                        paging=PagingConfig(ram_budget=1 << 20)), progress=False).model
    tokens = random_tokens(12, 5, VOCAB_SIZE)
    a = paged.forward(tokens, paged.new_cache(1, 16), all_logits=True)
    b = direct.forward(tokens, direct.new_cache(1, 16), all_logits=True)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
