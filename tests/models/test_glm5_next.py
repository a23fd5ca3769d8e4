"""GLM-5-Next on the tiny generated checkpoint (3 KDA layers with the bounded gate, one NoPE MLA
layer with the k-pool DSA indexer (pools of 2), a dense first layer, sigmoid routing with a shared
expert, hyper-connections over 2 streams) against transformers 5.23
`Glm5NextForConditionalGeneration` (eager attention; text-only input, so its vision tower is idle)
in fp32, with `index_topk` above the 80 positions used (nothing dropped) and below them (16, 4:
the indexer really selects)."""

from __future__ import annotations

import json

import pytest
import torch

from localmoe.convert import convert
from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.hyper_connections import HyperConnections
from localmoe.engine.layers.kda import KimiDeltaAttention
from localmoe.engine.layers.kpool_indexer import KPoolIndexer
from localmoe.engine.layers.mlp import GatedMLP
from localmoe.errors import UnsupportedModelError
from localmoe.models import family_for_model_type
from localmoe.testing.parity import (
    assert_batch_equals_single,
    assert_chunked_prefill_and_decode_equal_full,
    assert_prefill_and_greedy_decode_match,
    copy_with_config,
    earliest_ties,
    kv_cache_dtype,
    load_ours,
    load_reference,
    random_tokens,
    tiny_checkpoint,
)

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16
FAMILY = family_for_model_type("glm5_next")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("glm5_next", tmp_path_factory)


def with_topk(checkpoint, tmp_path_factory, top_k: int, reference: bool = True):
    path = copy_with_config(checkpoint, tmp_path_factory.mktemp(f"topk{top_k}"),
                            lambda config: config["text_config"].update(index_topk=top_k))
    ours = load_ours(path)
    if not reference:
        return ours, None
    # Glm5NextForConditionalGeneration: the image-text-to-text auto class, not the causal-LM one
    return ours, load_reference(transformers.AutoModelForImageTextToText, path, attn_implementation="eager")


@pytest.fixture(scope="module", params=[128, 16, 4], ids=lambda k: f"index_topk{k}")
def models(request, checkpoint, tmp_path_factory):
    return with_topk(checkpoint, tmp_path_factory, request.param)


def test_spec_reads_the_glm5_facts(models):
    ours = models[0]
    spec = ours.spec
    assert spec.layer_kinds == ("kda", "kda", "kda", "dsa") and spec.mlp_kinds == ("dense", "moe", "moe", "moe")
    assert (spec.hyper_connections.mult, spec.hyper_connections.sinkhorn_iters) == (2, 20)
    assert (spec.dsa.index_kpool, spec.dsa.index_kpool_tail) == (2, True)
    assert (spec.kda.bounded_gate, spec.kda.full_rank_gate, spec.kda.gate_lower_bound) == (True, False, -5.0)
    latent = spec.dsa.mla
    assert (latent.use_nope, latent.qk_rope_head_dim, spec.rms_norm_eps, latent.norm_eps) == (True, 0, 1e-5, 1e-5)
    assert (spec.scoring_func, spec.routed_scaling_factor, spec.glu_limit) == ("sigmoid", 2.5, 10.0)
    model = ours.model
    assert isinstance(model.residuals, HyperConnections)
    assert isinstance(model.layers[0][1], KimiDeltaAttention)
    assert isinstance(model.layers[3][1], DSAttention) and isinstance(model.layers[3][1].indexer, KPoolIndexer)


def test_tensor_names_are_canonical_and_the_vision_tower_is_skipped():
    tensors = FAMILY.hf_tensors
    assert tensors.resolve("model.language_model.layers.2.hc_ffn_fn")[0] == "layers.2.hc_ffn_fn"
    assert tensors.resolve("model.language_model.layers.3.self_attn.indexer.index_kpool_compress_ape")[0] == \
        "layers.3.self_attn.indexer.index_kpool_compress_ape"
    assert tensors.resolve("model.language_model.layers.1.mlp.gate.weight")[0] == "layers.1.mlp.router.weight"
    assert tensors.resolve("model.language_model.layers.1.mlp.experts.7.down_proj.weight")[0] == \
        "layers.1.mlp.experts.7.down.weight"
    assert tensors.resolve("model.visual.blocks.0.attn.qkv.weight") is None
    with pytest.raises(KeyError):
        tensors.resolve("model.language_model.layers.0.self_attn.conv1d.weight")  # transformers' fused name


def test_shared_indexer_layers_are_refused(checkpoint):
    config = json.loads((checkpoint / "config.json").read_text())
    config["text_config"]["indexer_types"] = ["full", "full", "full", "shared"]
    with pytest.raises(UnsupportedModelError, match="shared"):
        FAMILY.spec_from_hf(config)


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    with earliest_ties():  # transformers' indexer topk with the engine's tie rule
        assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE)


def test_selection_changes_the_output_below_the_context(models, checkpoint, tmp_path_factory):
    """With index_topk < the positions, logits differ from the no-drop model: selection really happens;
    queries that see fewer than index_topk + kpool tokens lose nothing."""
    ours = models[0]
    if ours.spec.dsa.index_topk >= 40:
        pytest.skip("no token is dropped at this index_topk")
    tokens = random_tokens(40, 5, ours.spec.vocab_size)
    got = ours.model.forward(tokens, ours.model.new_cache(1, 40), all_logits=True)
    dense = with_topk(checkpoint, tmp_path_factory, 64, reference=False)[0].model
    full = dense.forward(tokens, dense.new_cache(1, 40), all_logits=True)
    n = ours.spec.dsa.index_topk + ours.spec.dsa.index_kpool - 1
    torch.testing.assert_close(got[:, :n], full[:, :n], rtol=1e-5, atol=1e-5)
    assert (got[:, n:] - full[:, n:]).abs().max() > 1e-3


def test_prefill_then_decode_equals_full_forward(models):
    """Also with selection, where pool scores tie at relu zeros on a random tiny model: the tie rule
    (kernels/topk_select, the earlier pool) keeps the same pools whatever the call's shape."""
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(50, 2, vocab)
    assert_chunked_prefill_and_decode_equal_full(model, tokens, (23, 41), 64, rtol=1e-4, atol=1e-5)


def test_batch_of_two_equals_single_runs(models):
    model, vocab = models[0].model, models[0].spec.vocab_size
    assert_batch_equals_single(model, random_tokens(20, 3, vocab, batch=2), 24, rtol=1e-4, atol=1e-5)


def test_left_padded_row_pools_from_its_first_token(models):
    """A row left-padded by 7 gives the logits of its 13 real tokens alone: padding reaches neither the
    index keys nor the KDA state, and under selection pools start at the row's first real token, whose
    relu-zero ties the tie rule (kernels/topk_select, the earlier pool) breaks as for the row alone."""
    model, vocab = models[0].model, models[0].spec.vocab_size
    tokens = random_tokens(20, 4, vocab, batch=2)
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :7] = False
    both = model.forward(tokens, model.new_cache(2, 24), mask=mask, all_logits=True)
    single = model.forward(tokens[1:, 7:], model.new_cache(1, 24), all_logits=True)
    torch.testing.assert_close(both[1:, 7:], single, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "fp8"])
def test_cache_sizing_counts_keys_and_pool_gates(models, dtype):
    ours = models[0]
    with kv_cache_dtype(ours.model, dtype):
        cache = ours.model.new_cache(1, 64)
    assert cache.layers[3].index.dim == 2 * ours.spec.dsa.index_head_dim
    per_token = sum(layer.bytes_per_token() for layer in cache.layers if hasattr(layer, "bytes_per_token"))
    assert ours.spec.kv_bytes_per_token(dtype) == per_token  # KDA layers: a constant-size state


def test_every_swiglu_is_clamped_at_swiglu_limit(models):
    """Dense MLP, shared and routed experts: silu(min(g, 10)) * clamp(u, -10, 10), against float64."""
    model = models[0].model
    dense = model.layers[0][3]
    moe = model.layers[1][3]
    assert isinstance(dense, GatedMLP) and isinstance(moe.shared, GatedMLP)
    gate = torch.tensor([[-30.0, -1.0, 0.5, 9.0, 12.0, 40.0]])
    up = torch.tensor([[25.0, -14.0, 3.0, -2.0, 11.0, -40.0]])
    g, u = gate.double(), up.double()
    want = (g.clamp(max=10) * torch.sigmoid(g.clamp(max=10))) * u.clamp(-10, 10)
    for glu in (dense.glu, moe.shared.glu, moe.act):
        torch.testing.assert_close(glu(gate, up).double(), want, rtol=1e-6, atol=1e-6)


def test_packed_store_gives_the_hf_directory_logits(models, checkpoint, tmp_path):
    """A converted store (bf16 experts kept) runs with its experts left in the store, bit-identically."""
    ours = models[0]
    if ours.spec.dsa.index_topk != 4:
        pytest.skip("once is enough")
    convert(ours.source, tmp_path / "store", experts="keep")
    store = load_ours(tmp_path / "store").model
    tokens = random_tokens(40, 6, ours.spec.vocab_size)
    want = ours.model.forward(tokens, ours.model.new_cache(1, 40), all_logits=True)
    assert torch.equal(store.forward(tokens, store.new_cache(1, 40), all_logits=True), want)
