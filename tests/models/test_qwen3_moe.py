"""Qwen3-MoE against transformers' `Qwen3MoeForCausalLM` on tiny random configs, saved by transformers
itself (the Hub layout: one tensor per expert), loaded by our loader; and its packed store."""

from __future__ import annotations

import pytest
import torch

from localmoe.load import load_model
from localmoe.testing.families.qwen3_next import TOKENIZER
from localmoe.testing.tokenizer import VOCAB_SIZE, write_tokenizer

transformers = pytest.importorskip("transformers")

CASES = {"renormalised": {"norm_topk_prob": True, "mlp_only_layers": [1]},
         "raw-weights": {"norm_topk_prob": False, "decoder_sparse_step": 2}}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request, tmp_path_factory):
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False, **CASES[request.param])
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1: make them matter
        for name, p in reference.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp(f"qwen3_moe_{request.param}")
    reference.save_pretrained(path)
    write_tokenizer(path, TOKENIZER, 256)
    return reference, path


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-5) -> None:
    rel = ((a - b).abs().max() / b.abs().max()).item()
    assert rel < tol, f"max rel diff {rel:.2e}"


def test_spec_places_moe_and_dense_layers(pair):
    reference, path = pair
    spec = load_model(path, dtype="float32", progress=False).spec
    c = reference.config
    want = ["dense" if i in (c.mlp_only_layers or []) or (i + 1) % c.decoder_sparse_step else "moe" for i in range(3)]
    assert list(spec.mlp_kinds) == want and "dense" in want and "moe" in want
    assert (spec.num_experts, spec.num_experts_per_tok, spec.norm_topk_prob, spec.qk_norm) == \
        (8, 2, c.norm_topk_prob, True)


def test_prefill_and_cached_decode_match_transformers(pair):
    reference, path = pair
    ours = load_model(path, dtype="float32", expert_precision="exact", progress=False).model
    tokens = torch.randint(0, VOCAB_SIZE, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    cache = ours.new_cache(1, 64)
    _close(ours.forward(tokens[:, :32], cache, all_logits=True), expected[:, :32])
    steps = [ours.forward(tokens[:, t:t + 1], cache) for t in range(32, 40)]
    _close(torch.cat(steps, dim=1), expected[:, 32:])


@pytest.mark.parametrize("experts", ["keep", "mxfp4"])
def test_packed_store_pages_the_experts(pair, tmp_path, experts):
    """`convert` finds every expert (one tensor per expert); kept, the store gives the directory's logits
    to float32 noise: the same fp32 weights, but torch's sgemm rounds differently with the weights'
    memory alignment (page-aligned extents vs views into the safetensors file; measured 9e-8).
    Quantised to MXFP4 they stay close (a few % of the range on random weights)."""
    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.convert import convert

    _, path = pair
    convert(path, tmp_path / "store", experts=experts, progress=False)
    direct = load_model(path, dtype="float32", expert_precision="exact", progress=False).model
    paged = load_model(tmp_path / "store", EngineConfig(dtype="float32", expert_precision="exact",
                                                        paging=PagingConfig(ram_budget=1 << 20)), progress=False).model
    tokens = torch.randint(0, VOCAB_SIZE, (1, 12), generator=torch.Generator().manual_seed(2))
    a = paged.forward(tokens, paged.new_cache(1, 16), all_logits=True)
    b = direct.forward(tokens, direct.new_cache(1, 16), all_logits=True)
    span = (b.amax(-1) - b.amin(-1)).max()
    if experts == "keep":
        assert (a - b).abs().max() < 1e-6 * span
    else:
        assert 1e-4 * span < (a - b).abs().max() < 0.1 * span
