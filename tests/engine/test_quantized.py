"""4-bit GGML weights kept in their blocks (BlockLinear) against fp32 dequantise-then-matmul (decode rows
through kernels/ggml_gemv, x rounded to int8 per 32 values, where the CPU library is built)."""

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels import ggml_gemv

from localmoe.engine.linear import Linear, make_linear
from localmoe.engine.quantized import BlockEmbedding, BlockLinear, BlockQuantized, int4_kernel_available
from localmoe.load import load_model
from localmoe.store.gguf import GGUFFile

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="this torch has no CPU int4 GEMV")
Q = gguf.GGMLQuantizationType


def _synthetic(ggml_type, rows, cols, seed):
    x = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32) * 0.05
    raw = torch.from_numpy(gguf.quants.quantize(x, ggml_type).copy())
    return BlockQuantized(raw, ggml_type, (rows, cols))


def _rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q4_1], ids=["q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40], ids=lambda r: f"T{r}")
def test_int4_linear_matches_dequantised_fp32(ggml_type, rows):
    parts = [_synthetic(ggml_type, 96, 256, 1), _synthetic(ggml_type, 32, 256, 2)]  # stacked like q; k
    bias = torch.randn(128)
    reference = torch.cat([p.float() for p in parts])
    x = torch.randn(rows, 256)
    got = BlockLinear(parts, bias)(x)
    expected = x @ reference.T + bias
    # GEMV path: int8 activations (ggml_gemv) or bf16 ones and scales (torch int4); GEMM path (rows > 8): fp32
    assert _rel_rms(got, expected) < (1e-2 if rows <= 8 else 1e-6)


def test_codes_scales_zeros_reproduce_the_dequantised_weight():
    for ggml_type in (Q.Q4_0, Q.Q4_1):
        part = _synthetic(ggml_type, 16, 64, 3)
        q, d, zero = part.codes_scales_zeros()
        rebuilt = (q.float() - 8) * d.repeat_interleave(32, 1) + zero.repeat_interleave(32, 1)
        assert torch.allclose(rebuilt, part.float(), rtol=0, atol=1e-7)


@pytest.mark.skipif(not ggml_gemv.kernel_available(), reason="no CPU kernel library")
def test_q8_0_blocks_with_fp32_activations_match_the_dequantised_weight():
    """exact_x (the lm_head): x is not rounded, so the result is x W^T with the file's Q8_0 values to
    fp32 rounding; 4-bit blocks refuse it."""
    part = _synthetic(Q.Q8_0, 64, 256, 8)
    x = torch.randn(2, 256, dtype=torch.float64)
    got = BlockLinear([part], None, exact_x=True)(x.float())
    assert _rel_rms(got.double(), x @ part.float().double().T) < 1e-6
    with pytest.raises(ValueError, match="Q8_0"):
        BlockLinear([_synthetic(Q.Q4_1, 32, 64, 9)], None, exact_x=True)


@pytest.mark.skipif(not ggml_gemv.kernel_available(), reason="no CPU kernel library")
def test_the_embedded_head_follows_the_expert_precision(smollm2_gguf):
    """The tied Q8_0 lm_head of the embedded (dense) model: at expert precision q8-all its input is rounded to
    int8 per 32 values (the dequantised weight in float64 on q8_round(h)); at q8 (the default) to int16 per 32
    (q16_round(h)), at exact it reads fp32 (the same weight on h); the int16 head is ~2^-8 of the int8 head's
    distance from the fp32 one."""
    from localmoe.kernels.ggml_gemv import q16_round
    from localmoe.kernels.mxfp4_moe import q8_round

    from localmoe.config import EngineConfig

    precisions = ("q8", "q8-all", "exact")
    heads = {p: load_model(smollm2_gguf, EngineConfig(expert_precision=p, max_context=64),
                           progress=False).model.lm_head for p in precisions}
    assert [(heads[p].exact_x, heads[p].x16) for p in precisions] == [(False, True), (False, False), (True, False)]
    weight = heads["q8"].parts[0].float().double()
    h = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(2))
    h[:, 11] *= 20  # one large channel, as real hidden states have: rounding per 32 is coarse around it
    rounded, int16, exact = (heads[p](h).double() for p in ("q8-all", "q8", "exact"))
    scale = (h.double() @ weight.T).abs().max()
    assert ((rounded - q8_round(h.double()) @ weight.T).abs().max() / scale) < 1e-5
    assert ((int16 - q16_round(h.double()) @ weight.T).abs().max() / scale) < 1e-5
    assert ((exact - h.double() @ weight.T).abs().max() / scale) < 1e-5
    assert (rounded - exact).abs().max() / scale > 1e-4
    assert (int16 - exact).abs().max() < (rounded - exact).abs().max() / 50


@pytest.mark.skipif(not ggml_gemv.kernel_available(), reason="no CPU kernel library")
def test_rounded_rows_run_k_quant_prefill_on_the_block_kernel():
    """Inside rounded_rows() (a MoE model at expert precision q8) a prefill-sized call of K-quant parts (a Q4_K_M
    file's Q4_K q, k and Q6_K v) runs the block kernel: every row as it is alone (x rounded to int8 per 256, the
    GEMV reference's numbers), not the fp32 GEMM it runs outside; a Q8_0 matrix keeps the GEMM."""
    from localmoe.kernels.ggml_gemv import naive_ggml_gemv

    from localmoe.engine.quantized import rounded_rows
    from localmoe.testing.ggml_blocks import random_blocks

    rng = np.random.default_rng(11)
    parts = [BlockQuantized(torch.from_numpy(random_blocks(t, rows, 256, rng)), t, (rows, 256))
             for t, rows in ((Q.Q4_K, 64), (Q.Q4_K, 32), (Q.Q6_K, 32))]
    linear = BlockLinear(parts, None)
    x = torch.randn(40, 256)
    with rounded_rows():
        got = linear(x)
    alone = torch.cat([linear(x[i:i + 1]) for i in range(40)])
    assert torch.equal(got, alone)
    want = torch.cat([naive_ggml_gemv(x.double(), p.raw.reshape(p.shape[0], -1), p.ggml_type, p.shape) for p in parts],
                     dim=1)
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-5
    assert not torch.equal(linear(x), got)  # outside: the fp32 GEMM
    q8 = BlockLinear([_synthetic(Q.Q8_0, 64, 256, 14)], None)
    with rounded_rows():
        kept = q8(x)
    assert torch.equal(kept, q8(x))


def test_make_linear_keeps_blocks_only_in_auto_mode():
    parts = [_synthetic(Q.Q4_1, 32, 64, 4)]
    assert isinstance(make_linear(parts, None, "auto"), BlockLinear)
    assert isinstance(make_linear(parts, None, "float32"), Linear)
    q8_0 = make_linear([_synthetic(Q.Q8_0, 32, 64, 5)], None, "auto")  # 8-bit blocks need the CPU library
    assert isinstance(q8_0, BlockLinear if ggml_gemv.kernel_available() else Linear)


def test_real_model_layers_stay_4_bit_and_answer(smollm2_gguf):
    gguf_file = GGUFFile(smollm2_gguf)
    raw = BlockQuantized(gguf_file.raw("blk.3.ffn_up.weight"), Q.Q4_1, gguf_file.info("blk.3.ffn_up.weight").shape)
    x = torch.randn(1, 576)
    assert _rel_rms(BlockLinear([raw], None)(x), x @ raw.float().T) < 1e-2
    loaded = load_model(smollm2_gguf, dtype="auto", progress=False)
    assert isinstance(loaded.model.layers[0][3].gate_up, BlockLinear)
    from localmoe.engine.sampler import SamplingParams

    head = loaded.model.lm_head  # the tied Q8_0 embedding, on int16-rounded activations (engine/transformer.py _head),
    # repacked sixteen rows a group at load (Q8_0_R16)
    assert (head.ggml_type, head.x16) == (ggml_gemv.Q8_0_R16, True) if ggml_gemv.kernel_available() else \
        type(head) is Linear
    embed = loaded.model.embed  # the same blocks, rows dequantised per lookup: no float copy of the table
    tokens = torch.tensor([[0, 5, 49151], [7, 7, 2]])
    assert isinstance(embed, BlockEmbedding) and torch.equal(embed(tokens), F.embedding(tokens, embed.weight.float()))
    assert torch.equal(embed[5], embed.weight.float()[5])
    assert loaded.model.head_shares_embedding() == ggml_gemv.kernel_available()
    from localmoe.runtime.local import LocalModel

    answer = LocalModel(loaded).generate("What is the capital of France?", SamplingParams(temperature=0), 32)
    assert "Paris" in answer.content
    from localmoe.engine.decode_plan import DecodePlan

    # decode ran the whole stack in one kernel call, the 4-bit matrices in their own blocks
    assert isinstance(loaded.model._plan, DecodePlan) == ggml_gemv.kernel_available()


@pytest.mark.skipif(not ggml_gemv.kernel_available(), reason="no CPU kernel library")
def test_decode_plan_on_gguf_blocks_follows_the_op_by_op_step(smollm2_gguf, monkeypatch):
    """The embedded model's decode plan reads the Q4_1 matrices through the kernels' Matrix descriptors;
    the op-by-op step reads the same blocks through BlockLinear. Both round every matrix input to int8
    (ggml_gemv), and their different fp32 rounding moves some of those roundings, so they agree to a
    few % of the logit range (measured 2.2 % at most over 13 steps; fp32 weights agree to 8e-7) and on
    every greedy token."""
    from localmoe.engine.decode_plan import DecodePlan

    loaded = load_model(smollm2_gguf, dtype="auto", progress=False)
    model = loaded.model
    prompt = torch.tensor([loaded.tokenizer.encode("The capital of France is")])

    def run() -> torch.Tensor:
        model._plan = None
        cache = model.new_cache(1, 64)
        out = [model.forward(prompt, cache)[:, -1:]]
        for _ in range(12):
            out.append(model.forward(out[-1].argmax(-1), cache))
        return torch.cat(out, dim=1)

    planned = run()
    assert isinstance(model._plan, DecodePlan)
    monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, m: None))
    op_by_op = run()
    span = op_by_op.amax(-1) - op_by_op.amin(-1)
    assert ((planned - op_by_op).abs().amax(-1) / span).max() < 0.05
    assert torch.equal(planned.argmax(-1), op_by_op.argmax(-1))


@pytest.mark.skipif(not ggml_gemv.kernel_available(), reason="no CPU kernel library")
def test_k_quant_model_from_its_blocks_matches_transformers(monkeypatch):
    """A tiny Llama whose matrices are GGUF blocks of mixed types as Q4_K_M / Q5_K_M files mix them (embedding,
    q, k in Q4_K; v, down and the head in Q6_K; o in Q5_K; gate Q5_0 and up Q5_1, so q; k; v and gate; up
    each stack two types) decodes from its blocks, op by op
    (BlockLinear segments) and through the decode plan (a stacked Matrix). The reference is transformers
    with the same weights dequantised by gguf's own code and, as the block GEMVs do at decode, every
    layer matrix's input rounded to int8 (reference.q8_round: per 32 values for gate and up, per 256 for the
    K-quant matrices) at the decoded positions, computed in float64;
    prefill runs fp32 GEMMs on the dequantised weights, unrounded, in both."""
    from localmoe.kernels.mxfp4_moe import q8_round

    from localmoe.config import EngineConfig
    from localmoe.engine.decode_plan import DecodePlan
    from localmoe.load import build_from_tensors
    from localmoe.models import family_for_model_type
    from localmoe.testing.ggml_blocks import random_blocks

    transformers = pytest.importorskip("transformers")
    kinds = {"v_proj.weight": Q.Q6_K, "down_proj.weight": Q.Q6_K, "lm_head.weight": Q.Q6_K,
             "o_proj.weight": Q.Q5_K, "gate_proj.weight": Q.Q5_0, "up_proj.weight": Q.Q5_1}
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=128, tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    rng = np.random.default_rng(0)
    tensors = dict(reference.state_dict())
    for name, t in reference.state_dict().items():
        if t.dim() == 2:  # the embedding in Q4_K too (BlockEmbedding), the untied head in Q6_K (fp32 x)
            kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), Q.Q4_K)
            raw = random_blocks(kind, *t.shape, rng, step=(2e-4, 1e-3))
            t.copy_(torch.from_numpy(gguf.quants.dequantize(raw, kind)))  # the reference's weight, independently
            tensors[name] = BlockQuantized(torch.from_numpy(raw), kind, tuple(t.shape))
    family = family_for_model_type("llama")
    ours = build_from_tensors(family, family.spec_from_hf(config.to_dict()), tensors, family.hf_tensors,
                              EngineConfig(dtype="auto"))
    qkv = ours.layers[0][1].qkv
    assert isinstance(qkv, BlockLinear) and [k for _, k, _ in qkv.segments] == [Q.Q4_K, Q.Q6_K]
    assert [k for _, k, _ in ours.layers[0][3].gate_up.segments] == [Q.Q5_0, Q.Q5_1]
    assert isinstance(ours.embed, BlockEmbedding) and (ours.lm_head.ggml_type, ours.lm_head.exact_x) == (Q.Q6_K, True)
    tokens = torch.randint(0, 97, (1, 24), generator=torch.Generator().manual_seed(1))
    reference = reference.double()  # in float32 the reference alone was 1.0e-5 of the range off its float64 self

    def round_decoded(block: int):
        def hook(module, args):
            x = args[0].clone()
            x[:, 16:] = q8_round(x[:, 16:], block)
            return (x,)
        return hook

    for layer in reference.model.layers:
        for name, module in layer.named_modules():
            if isinstance(module, torch.nn.Linear):  # per 32 values for Q5_0 / Q5_1, per 256 for the K-quants
                module.register_forward_pre_hook(round_decoded(32 if name.endswith(("gate_proj", "up_proj")) else 256))
    with torch.no_grad():
        expected = reference(tokens).logits[:, 16:]

    def decode() -> torch.Tensor:
        ours._plan = None
        cache = ours.new_cache(1, 32)
        ours.forward(tokens[:, :16], cache)
        return torch.cat([ours.forward(tokens[:, t:t + 1], cache) for t in range(16, 24)], dim=1)

    planned = decode()
    assert isinstance(ours._plan, DecodePlan)
    monkeypatch.setattr(DecodePlan, "build", classmethod(lambda cls, m: None))
    op_by_op = decode()
    span = expected.amax(-1, keepdim=True) - expected.amin(-1, keepdim=True)
    for got in (planned, op_by_op):
        err = ((got - expected).abs() / span).amax(-1).flatten()  # per decoded position
        # An input value within fp32 noise of an int8 rounding boundary may round the other way than in the float64
        # reference: one step of one value at that position (since session 9's Q6_K chain, 1.0e-5 and 7.5e-6 at 2 of the
        # 8 positions, both paths alike; 0.7-2.2e-7 at the others). Unrounded inputs: 8.4e-2.
        assert err.max() < 5e-5 and int((err < 1e-6).sum()) >= 6, err
        assert torch.equal(got.argmax(-1), expected.argmax(-1))
