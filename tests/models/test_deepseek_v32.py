"""DeepSeek-V3.2 on the tiny generated checkpoint (MLA with q LoRA and interleaved RoPE under
YaRN, the DSA lightning indexer in every layer, a dense first layer, sigmoid group-limited
routing with correction bias, a shared expert) against transformers 5.23
`DeepseekV32ForCausalLM` (eager attention) in fp32, with `index_topk` above the 80 positions
used (no token dropped) and below them (4, 16: the indexer really selects)."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.index_cache import DSACache
from localmoe.models import family_for_model_type
from localmoe.testing.parity import (
    assert_chunked_prefill_and_decode_equal_full,
    assert_prefill_and_greedy_decode_match,
    copy_with_config,
    earliest_ties,
    kv_cache_dtype,
    load_pair,
    random_tokens,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16
HF_TENSORS = family_for_model_type("deepseek_v32").hf_tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("deepseek_v32", tmp_path_factory)


def with_topk(checkpoint, tmp_path_factory, top_k: int):
    path = copy_with_config(checkpoint, tmp_path_factory.mktemp(f"topk{top_k}"),
                            lambda config: config.update(index_topk=top_k))
    return load_pair(path, transformers.AutoModelForCausalLM, attn_implementation="eager")


@pytest.fixture(scope="module", params=[128, 16, 4], ids=lambda k: f"index_topk{k}")
def models(request, checkpoint, tmp_path_factory):
    return with_topk(checkpoint, tmp_path_factory, request.param)


def test_spec_reads_the_deepseek_facts(models):
    spec = models[0].spec
    assert spec.layer_kinds == ("dsa",) * 4 and spec.mlp_kinds == ("dense", "moe", "moe", "moe")
    assert (spec.scoring_func, spec.n_group, spec.topk_group, spec.routed_scaling_factor) == ("sigmoid", 2, 1, 2.5)
    assert (spec.dsa.index_n_heads, spec.dsa.index_head_dim, spec.dsa.mla.use_nope) == (2, 16, False)
    assert all(isinstance(mixer, DSAttention) for _, mixer, _, _ in models[0].model.layers)


def test_router_and_indexer_names_are_canonical():
    assert HF_TENSORS.resolve("model.layers.1.mlp.gate.weight")[0] == "layers.1.mlp.router.weight"
    assert HF_TENSORS.resolve("model.layers.1.mlp.gate.e_score_correction_bias")[0] == \
        "layers.1.mlp.router.e_score_correction_bias"
    assert HF_TENSORS.resolve("model.layers.2.self_attn.indexer.k_norm.bias")[0] == \
        "layers.2.self_attn.indexer.k_norm.bias"
    with pytest.raises(KeyError):
        HF_TENSORS.resolve("model.layers.2.self_attn.indexer.wq_a.weight")


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    with earliest_ties():  # transformers' indexer topk with the engine's tie rule
        assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE)


def test_selection_changes_the_output_below_the_context(models, checkpoint, tmp_path_factory):
    """With index_topk < the positions, logits differ from the no-drop model: selection really happens."""
    ours = models[0]
    tokens = random_tokens(40, 5, ours.spec.vocab_size)
    got = ours.model.forward(tokens, ours.model.new_cache(1, 40), all_logits=True)
    if ours.spec.dsa.index_topk >= 40:
        pytest.skip("no token is dropped at this index_topk")
    dense = with_topk(checkpoint, tmp_path_factory, 64)[0].model
    full = dense.forward(tokens, dense.new_cache(1, 40), all_logits=True)
    k = ours.spec.dsa.index_topk
    torch.testing.assert_close(got[:, :k], full[:, :k], rtol=1e-5, atol=1e-5)  # queries seeing <= k tokens
    assert (got[:, k:] - full[:, k:]).abs().max() > 1e-3


def test_prefill_then_decode_equals_full_forward(models):
    """Also below the context, where the random tiny model's relu-zero scores tie: the tie rule
    (kernels/topk_select, the earlier token) keeps the same set whatever the call's shape."""
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(50, 2, vocab)
    cache = assert_chunked_prefill_and_decode_equal_full(model, tokens, (30,), 64, rtol=1e-4, atol=1e-5)
    assert isinstance(cache.layers[0], DSACache) and cache.layers[0].index.rows.heads == 1


def test_fp8_index_keys_are_compact_and_close(models):
    """fp8 index cache: index_head_dim e4m3 bytes + one fp32 scale per block, keys within e4m3 precision."""
    ours = models[0]
    model = ours.model
    tokens = random_tokens(40, 4, ours.spec.vocab_size)
    exact_cache = model.new_cache(1, 40)
    model.forward(tokens, exact_cache)
    with kv_cache_dtype(model, "fp8"):
        cache = model.new_cache(1, 40)
        model.forward(tokens, cache)
    index = cache.layers[0].index
    assert index.bytes_per_token() == ours.spec.dsa.index_head_dim + 4
    exact = exact_cache.layers[0].index.rows.read(40)
    lossy = index.rows.read(40)
    scale = exact.abs().amax(-1, keepdim=True)
    assert ((lossy - exact).abs() <= scale * 2 ** -4).all()  # e4m3: 3 mantissa bits
    assert (lossy - exact).abs().max() > 0  # really rounded (beyond the exact ring of recent positions)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "fp8"])
def test_cache_sizing_counts_the_index_keys(models, dtype):
    ours = models[0]
    with kv_cache_dtype(ours.model, dtype):
        cache = ours.model.new_cache(1, 64)
    assert ours.spec.kv_bytes_per_token(dtype) == sum(layer.bytes_per_token() for layer in cache.layers)


def test_deepseek_v3_without_the_indexer_matches_transformers(tmp_path_factory):
    """DeepSeek-V3 (`deepseek_v3`: the V3.2 layout without the indexer, plain MLA layers) against
    transformers' `DeepseekV3ForCausalLM`."""
    path = tiny_checkpoint("deepseek_v3", tmp_path_factory)
    ours, reference = load_pair(path, transformers.AutoModelForCausalLM, attn_implementation="eager")
    assert ours.spec.layer_kinds == ("mla",) * 4 and ours.spec.dsa is None
    assert_prefill_and_greedy_decode_match(ours.model, reference, random_tokens(PREFILL, 1, ours.spec.vocab_size),
                                           DECODE)


def test_the_appended_mtp_layer_is_skipped(tmp_path_factory):
    """A DeepSeek-V3 checkpoint as released carries its MTP layer as `model.layers.{num_hidden_layers}.*` (a whole
    decoder layer plus `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, `shared_head.{norm,head}`): with
    `num_nextn_predict_layers` declared it loads and gives the logits of the checkpoint without it."""
    from safetensors.torch import load_file, save_file

    from localmoe.errors import CheckpointError
    from localmoe.testing.parity import load_ours

    path = tiny_checkpoint("deepseek_v3", tmp_path_factory)
    with_mtp = copy_with_config(path, tmp_path_factory.mktemp("mtp"), lambda c: c.update(num_nextn_predict_layers=1))
    tensors = load_file(with_mtp / "model.safetensors")
    last = max(int(n.split(".")[2]) for n in tensors if n.startswith("model.layers."))
    mtp = f"model.layers.{last + 1}."
    tensors |= {n.replace(f"model.layers.{last}.", mtp): t.clone() for n, t in tensors.items()
                if n.startswith(f"model.layers.{last}.")}
    D = tensors["model.norm.weight"].shape[0]
    tensors |= {mtp + "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
                mtp + "enorm.weight": torch.ones(D), mtp + "hnorm.weight": torch.ones(D),
                mtp + "eh_proj.weight": torch.zeros(D, 2 * D), mtp + "shared_head.norm.weight": torch.ones(D),
                mtp + "shared_head.head.weight": tensors["lm_head.weight"].clone()}
    save_file(tensors, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    ours, plain = load_ours(with_mtp), load_ours(path)
    assert ours.spec.nextn_layers == 1 and ours.spec.num_layers == plain.spec.num_layers
    tokens = random_tokens(12, 6, plain.spec.vocab_size)
    torch.testing.assert_close(ours.model.forward(tokens, ours.model.new_cache(1, 16), all_logits=True),
                               plain.model.forward(tokens, plain.model.new_cache(1, 16), all_logits=True), rtol=0, atol=0)
    undeclared = copy_with_config(with_mtp, tmp_path_factory.mktemp("undeclared"),
                                  lambda c: c.pop("num_nextn_predict_layers"))
    with pytest.raises(CheckpointError, match=rf"layers\.{last + 1}\."):
        load_ours(undeclared)
