"""Kimi K3 on the tiny generated checkpoint against the float64 oracle in tests/models/k3_oracle.py
(written from MODELS.md, sharing no code with the engine), plus the checkpoint quirks one by one:
the `language_model.` prefix, compressed-tensors MXFP4 experts loaded as they are, the latent
MoE, SiTU everywhere `hidden_act` says so, and the attention-residual mix against float64."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.layers.attn_res import AttentionResiduals, depth_mix
from localmoe.engine.layers.moe import MoEBlock
from localmoe.load import load_model
from localmoe.models import family_for_model_type
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import max_diff, random_tokens

from .k3_oracle import K3Oracle, decode_mxfp4

PREFILL, DECODE = 64, 16
HF_TENSORS = family_for_model_type("kimi_k3").hf_tensors


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("kimi_k3", tmp_path_factory.mktemp("kimi_k3"), "tiny", seed=0)


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint, EngineConfig(dtype="float32", threads=1, expert_precision="exact"), progress=False)


@pytest.fixture(scope="module")
def oracle(checkpoint):
    return K3Oracle(checkpoint)


def test_spec_reads_the_k3_facts(ours, oracle):
    spec, c = ours.spec, oracle.c
    full = set(c["linear_attn_config"]["full_attn_layers"])
    assert spec.layer_kinds == tuple("mla" if i + 1 in full else "kda" for i in range(c["num_hidden_layers"]))
    assert spec.mlp_kinds[0] == "dense" and set(spec.mlp_kinds[1:]) == {"latent_moe"}
    assert (spec.scoring_func, spec.expert_act, spec.hidden_act) == ("sigmoid", "situ", "situ")
    assert (spec.kda.bounded_gate, spec.kda.full_rank_gate, spec.mla.output_gate, spec.mla.use_nope) == (True,) * 4
    assert spec.attn_res.block_size == c["attn_res_block_size"]
    assert spec.latent_moe_size == c["routed_expert_hidden_size"]


def test_language_model_prefix_and_k3_names_are_renamed():
    assert HF_TENSORS.resolve("language_model.model.embed_tokens.weight")[0] == "embed_tokens.weight"
    assert HF_TENSORS.resolve("language_model.lm_head.weight")[0] == "lm_head.weight"
    assert HF_TENSORS.resolve("language_model.model.output_attn_res_proj.weight")[0] == "output_attn_res_proj.weight"
    assert HF_TENSORS.resolve("language_model.model.layers.5.mlp_res_norm.weight")[0] == \
        "layers.5.mlp_res_norm.weight"
    stem = "language_model.model.layers.2.block_sparse_moe"
    assert HF_TENSORS.resolve(f"{stem}.routed_expert_down_proj.weight")[0] == \
        "layers.2.mlp.routed_expert_down_proj.weight"
    for src, dst in (("w1", "gate"), ("w3", "up"), ("w2", "down")):
        assert HF_TENSORS.resolve(f"{stem}.experts.9.{src}.weight_packed")[0] == f"layers.2.mlp.experts.9.{dst}.packed"
        assert HF_TENSORS.resolve(f"{stem}.experts.9.{src}.weight_scale")[0] == f"layers.2.mlp.experts.9.{dst}.scales"
    assert HF_TENSORS.resolve("language_model.model.layers.0.rotary_emb.inv_freq") is None
    for unknown in ("model.embed_tokens.weight", f"{stem}.experts.9.w1.weight"):  # no prefix / not compressed
        with pytest.raises(KeyError):
            HF_TENSORS.resolve(unknown)


def test_compressed_tensors_experts_stay_mxfp4_and_decode_as_the_oracle(ours, oracle):
    block = ours.model.moe_blocks()[0]
    layer = block.layer
    expert = block.experts.get(layer, 3)
    stem = f"model.layers.{layer}.block_sparse_moe.experts.3"
    for proj, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        got = getattr(expert, proj)
        assert got.weight is None and got.packed.dtype == torch.uint8  # no float copy is kept
        want = decode_mxfp4(oracle.w[f"{stem}.{w}.weight_packed"], oracle.w[f"{stem}.{w}.weight_scale"])
        assert torch.equal(got.dense(torch.float64), want)


def test_latent_moe_runs_experts_at_the_latent_width(ours):
    block = ours.model.moe_blocks()[0]
    assert isinstance(block, MoEBlock) and block.latent is not None
    assert block.experts.get(block.layer, 0).gate.dense().shape == (ours.spec.moe_intermediate_size,
                                                                    ours.spec.latent_moe_size)


def test_depth_mix_matches_float64():
    g = torch.Generator().manual_seed(1)
    values = [torch.randn(2, 3, 16, generator=g) * s for s in (1.0, 5.0, 0.1, 30.0)]
    query = torch.randn(16, generator=g)
    got = depth_mix(values, query, 1e-5)
    for b in range(2):
        for t in range(3):
            vs = [v[b, t].double() for v in values]
            scores = torch.stack([(v / torch.sqrt((v * v).mean() + 1e-5) * query.double()).sum() for v in vs])
            want = sum(w * v for w, v in zip(scores.softmax(0), vs))
            torch.testing.assert_close(got[b, t].double(), want, rtol=1e-5, atol=1e-5)


def test_depth_mix_prefill_sums_as_einsum():
    """The prefill form adds the weighted entries in order: the bits of the einsum it replaced, for 1..12 entries
    (K3 has up to 9) over rows of very different scales."""
    for entries in range(1, 13):
        g = torch.Generator().manual_seed(entries)
        values = [torch.randn(1, 40, 96, generator=g) * torch.logspace(-3, 3, 96) for _ in range(entries)]
        query = torch.randn(96, generator=g)
        V = torch.stack(values)
        k = V * torch.rsqrt(V.square().mean(-1, keepdim=True) + 1e-6)
        want = torch.einsum("nbt,nbtd->btd", (k @ query).softmax(dim=0), V)
        assert torch.equal(depth_mix(values, query, 1e-6), want), entries


def test_attention_residual_blocks_restart_every_block_size_layers():
    """With sublayers that return known vectors, which representations each mix sees is visible
    in its output: a query that only looks at one direction picks out one entry."""
    D, layers, block = 4, 5, 2
    seen: list[int] = []

    def attn(i, h):
        seen.append(len(h.shape))
        return torch.full((1, 1, D), float(i + 1))

    def mlp(i, h):
        return torch.full((1, 1, D), 10.0 * (i + 1))

    zero = torch.zeros(D)
    res = AttentionResiduals(block, [zero] * layers, [zero] * layers, zero, 1e-6)  # zero query: uniform mix
    out = res.run(torch.ones(1, 1, D), attn, mlp)
    # blocks: [embedding 1], then ps of layers 0-1 = 1+10+2+20 = 33 stored at layer 2, then layers 2-3
    # = 3+30+4+40 = 77 stored at layer 4; the final partial sum is layer 4's 5+50 = 55.
    assert seen == [3] * layers
    torch.testing.assert_close(out, torch.full((1, 1, D), (1 + 33 + 77 + 55) / 4))


def test_prefill_matches_the_float64_oracle(ours, oracle):
    tokens = random_tokens(PREFILL, seed=3, vocab=ours.spec.vocab_size)
    got = ours.model.forward(tokens, ours.model.new_cache(1, PREFILL), all_logits=True)[0]
    want = oracle.logits(tokens[0].tolist())
    err, rel = max_diff(got.double(), want)
    assert rel < 1e-3, f"max abs {err:.2e}, rel {rel:.2e}"
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_cached_greedy_decode_matches_the_oracle(ours, oracle):
    """16 cached greedy steps; the oracle is causal, so one forward over the final sequence gives
    its logits at every step."""
    prompt = random_tokens(PREFILL - DECODE, seed=4, vocab=ours.spec.vocab_size)
    cache = ours.model.new_cache(1, PREFILL)
    steps = [ours.model.forward(prompt, cache)[0, -1]]
    tokens = prompt[0].tolist()
    for _ in range(DECODE - 1):
        tokens.append(int(steps[-1].argmax()))
        steps.append(ours.model.forward(torch.tensor([[tokens[-1]]]), cache)[0, -1])
    want = oracle.logits(tokens)[PREFILL - DECODE - 1:]
    for step, (got, expected) in enumerate(zip(steps, want)):
        err, rel = max_diff(got.double(), expected)
        assert rel < 1e-3, f"decode step {step}: max abs {err:.2e}, rel {rel:.2e}"
        assert got.argmax().item() == expected.argmax().item(), f"greedy token differs at step {step}"
