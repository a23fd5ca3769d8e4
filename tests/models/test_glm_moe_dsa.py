"""GLM-5 (`glm_moe_dsa`) against transformers 5.23 `GlmMoeDsaForCausalLM` (eager attention) in fp32: the
generated tiny checkpoint (DeepSeek-V3.2's layout, indexer_types full/shared/shared/full/shared) with
`index_topk` above the 64 positions used and below them (16, 4: the indexer really selects, and the shared
layers reuse its selection), a checkpoint transformers itself saved from a `index_topk_pattern`, the
interleaved indexer RoPE, and the packed store paged == resident."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from localmoe.config import EngineConfig, PagingConfig
from localmoe.engine.layers.dsa import DSAttention
from localmoe.engine.layers.dsa_shared import SharedDSAttention
from localmoe.errors import UnsupportedModelError
from localmoe.load import load_model
from localmoe.models import family_for_model_type
from localmoe.testing.families.glm5_next import TOKENIZER
from localmoe.testing.parity import (
    assert_prefill_and_greedy_decode_match,
    copy_with_config,
    earliest_ties,
    load_ours,
    load_pair,
    random_tokens,
    tiny_checkpoint,
)
from localmoe.testing.tokenizer import write_tokenizer

transformers = pytest.importorskip("transformers")

PREFILL, DECODE = 64, 16


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return tiny_checkpoint("glm_moe_dsa", tmp_path_factory)


def with_topk(checkpoint, tmp_path_factory, top_k: int):
    path = copy_with_config(checkpoint, tmp_path_factory.mktemp(f"topk{top_k}"),
                            lambda config: config.update(index_topk=top_k))
    return load_pair(path, transformers.AutoModelForCausalLM, attn_implementation="eager")


@pytest.fixture(scope="module", params=[128, 16, 4], ids=lambda k: f"index_topk{k}")
def models(request, checkpoint, tmp_path_factory):
    return with_topk(checkpoint, tmp_path_factory, request.param)


def test_spec_reads_the_glm_dsa_facts(models):
    ours, reference = models
    spec = ours.spec
    assert spec.layer_kinds == ("dsa", "dsa_shared", "dsa_shared", "dsa", "dsa_shared")
    assert spec.mlp_kinds == ("dense", "moe", "moe", "moe", "moe")
    assert (spec.scoring_func, spec.n_group, spec.routed_scaling_factor, spec.rope_scaling) == ("sigmoid", 1, 2.5, None)
    assert spec.dsa.index_rope_interleaved and not spec.dsa.mla.use_nope
    mixers = [mixer for _, mixer, _, _ in ours.model.layers]
    assert [type(m) for m in mixers] == [DSAttention, SharedDSAttention, SharedDSAttention, DSAttention,
                                         SharedDSAttention]
    assert [layer.self_attn.indexer is None for layer in reference.model.layers] == \
        [t == "dsa_shared" for t in spec.layer_kinds]


def test_the_checkpoint_holds_what_transformers_saves(checkpoint, tmp_path):
    """The generated layout is transformers' own: the same tensor names (no indexer in shared layers)."""
    from safetensors import safe_open

    reference = transformers.AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    reference.save_pretrained(tmp_path)
    with safe_open(tmp_path / "model.safetensors", "pt") as saved, \
            safe_open(checkpoint / "model.safetensors", "pt") as generated:
        names = set(generated.keys())
        assert set(saved.keys()) == names
    assert any(".layers.0.self_attn.indexer." in n for n in names)
    assert not any(".layers.1.self_attn.indexer." in n for n in names)


def test_prefill_and_cached_greedy_decode_match_transformers(models):
    ours, reference = models
    prompt = random_tokens(PREFILL, 1, ours.spec.vocab_size)
    with earliest_ties():  # transformers' indexer topk with the engine's tie rule
        assert_prefill_and_greedy_decode_match(ours.model, reference, prompt, DECODE, rtol=1e-5)


def test_half_split_indexer_rope_or_own_selection_would_differ(models):
    """Below the context the indexer's interleaved RoPE and the shared layers' reuse both change the logits:
    the matches above could fail."""
    ours, reference = models
    k = ours.spec.dsa.index_topk
    if k >= PREFILL:
        pytest.skip("no token is dropped at this index_topk")
    tokens = random_tokens(40, 5, ours.spec.vocab_size)
    with torch.no_grad():
        want = reference(tokens).logits
    model = ours.model
    for _, mixer, _, _ in model.layers:
        if type(mixer) is DSAttention:
            mixer.indexer.interleaved = False
    try:
        half_split = model.forward(tokens, model.new_cache(1, 40), all_logits=True)
    finally:
        for _, mixer, _, _ in model.layers:
            if type(mixer) is DSAttention:
                mixer.indexer.interleaved = True
    assert (half_split[0, k:] - want[0, k:]).abs().max() > 1e-3
    for _, mixer, _, _ in model.layers:
        if type(mixer) is SharedDSAttention:
            mixer.dense_context = 1 << 20
    try:
        dense_shared = model.forward(tokens, model.new_cache(1, 40), all_logits=True)
    finally:
        for _, mixer, _, _ in model.layers:
            if type(mixer) is SharedDSAttention:
                mixer.dense_context = k
    assert (dense_shared[0, k:] - want[0, k:]).abs().max() > 1e-3


def test_cache_sizing_counts_no_index_keys_for_shared_layers(models):
    ours = models[0]
    cache = ours.model.new_cache(1, 64)
    assert ours.spec.kv_bytes_per_token("float32") == sum(layer.bytes_per_token() for layer in cache.layers)
    rows = ours.spec.dsa.mla.row_dim
    assert [layer.bytes_per_token() for layer in cache.layers][1] == 4 * rows


@pytest.fixture(scope="module")
def saved_by_transformers(checkpoint, tmp_path_factory):
    """A random GlmMoeDsaForCausalLM transformers builds from `index_topk_pattern` "FSFS" and saves."""
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    for key in ("indexer_types", "architectures", "model_type", "dtype"):
        config.pop(key)
    config.update(num_hidden_layers=4, index_topk=8, index_topk_pattern="FSFS")
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(transformers.GlmMoeDsaConfig(**config),
                                                              dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():  # random init leaves norms at 1, biases at 0: make them matter
        for name, p in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
        for layer in reference.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("glm_moe_dsa_saved")
    reference.save_pretrained(path)
    write_tokenizer(path, TOKENIZER, config["vocab_size"])
    return reference, path


def test_a_checkpoint_transformers_saved_matches_it(saved_by_transformers):
    reference, path = saved_by_transformers
    ours = load_ours(path)
    assert ours.spec.layer_kinds == ("dsa", "dsa_shared", "dsa", "dsa_shared")
    with earliest_ties():
        assert_prefill_and_greedy_decode_match(ours.model, reference, random_tokens(40, 4, ours.spec.vocab_size), 8,
                                               rtol=1e-5)


def test_a_first_shared_layer_is_refused(checkpoint, tmp_path):
    copy = copy_with_config(checkpoint, tmp_path / "bad", lambda c: c.update(indexer_types=["shared"] * 5))
    with pytest.raises(UnsupportedModelError, match="indexer_types"):
        load_ours(copy)


def test_packed_store_paged_equals_resident(checkpoint, tmp_path):
    """`convert` packs every routed expert; the store paged at a 1 MB budget gives the directory's logits
    (prefill with selection below the context, then greedy decode steps)."""
    from localmoe.convert import convert

    source = copy_with_config(checkpoint, tmp_path / "src", lambda c: c.update(index_topk=8))
    convert(source, tmp_path / "store", experts="keep", progress=False)
    direct = load_ours(source).model
    paged = load_model(tmp_path / "store", EngineConfig(dtype="float32", expert_precision="exact", threads=1,
                                                        paging=PagingConfig(ram_budget=1 << 20)), progress=False)
    assert paged.spec.layer_kinds == load_ours(source).spec.layer_kinds
    assert dataclasses.asdict(paged.spec.dsa) == dataclasses.asdict(load_ours(source).spec.dsa)
    paged = paged.model
    tokens = random_tokens(24, 5, paged.spec.vocab_size)
    caches = [m.new_cache(1, 32) for m in (paged, direct)]
    outs = [m.forward(tokens, c, all_logits=True) for m, c in zip((paged, direct), caches)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    token = outs[1][:, -1:].argmax(-1)
    for _ in range(4):
        a, b = (m.forward(token, c) for m, c in zip((paged, direct), caches))
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        token = b[:, -1:].argmax(-1)


def test_glm5_is_a_model_type_of_the_deepseek_family():
    assert family_for_model_type("glm_moe_dsa").name == "deepseek_v32"  # V3.2 with two changes


def test_gguf_indexer_types_follow_llama_cpp_when_absent():
    """`attention.indexer.types` read as true = full; absent: all full below a 1M context (GLM-5, 5.1), else
    GLM-5.2's pattern (llama.cpp's GLM_5_2_DEFAULT_INDEXER_TYPES: 1, 1, then 1, 0, 0, 0 repeated)."""
    from localmoe.models.deepseek_v32 import glm_gguf_indexer_types
    from localmoe.models.gguf_experts import GGUFKeys

    def types(**meta):
        return glm_gguf_indexer_types(GGUFKeys({f"glm-dsa.{k.replace('__', '.')}": v for k, v in meta.items()},
                                               "glm-dsa"), 10)

    assert types(context_length=202752) == ["full"] * 10
    S, F = "shared", "full"
    assert types(context_length=1048576) == [F, F, F, S, S, S, F, S, S, S]
    assert types(context_length=1048576, attention__indexer__types=[True, False] * 5) == [F, S] * 5


def test_recording_shows_shared_layers_attend_to_the_full_layers_selection(models):
    """probe-recall's `record_selection`: a shared layer records the selection of the full layer before it, and
    recording changes no logit (also while nothing is dropped: the shared layer then attends to all it sees)."""
    ours = models[0]
    model, k = ours.model, ours.spec.dsa.index_topk
    tokens = random_tokens(20, 6, ours.spec.vocab_size)
    plain = model.forward(tokens, model.new_cache(1, 20), all_logits=True)
    mixers = [mixer for _, mixer, _, _ in model.layers]
    for m in mixers:
        m.record_selection, m.last_selection = True, None
    try:
        recorded = model.forward(tokens, model.new_cache(1, 20), all_logits=True)
    finally:
        for m in mixers:
            m.record_selection = False
    torch.testing.assert_close(recorded, plain, rtol=1e-6, atol=1e-6)
    assert mixers[1].last_selection is mixers[0].last_selection and mixers[2].last_selection is mixers[0].last_selection
    assert mixers[4].last_selection is mixers[3].last_selection is not mixers[0].last_selection
    assert mixers[0].last_selection.shape[-1] == k  # -1 pads beyond the visible tokens
