"""The decode plans over many rows (kernels/decode_layers `decode_dense_rows`, `decode_gqa_moe_rows` and
`decode_hybrid_rows`,
engine/batch.py `forward_rows` through `rows_plan`): every row of a batched step has the bits the fused
single-sequence step (`decode_dense` / `decode_gqa_moe`, what `localmoe run` decodes with) gives its sequence alone,
for 1, 2, 5, 8 and 16 sequences of different lengths, for a sequence on several rows (a speculative verify, a prompt
chunk), for a prompt chunk past one GEMV slice (matrix.h kMatrowsSlice) and one exact MoE kernel call's row limit
(EXACT_TOKEN_ROWS), on the AVX2 and AVX-512 builds; a greedy run with a prompt-lookup speculator gives the tokens of
the run without; and the logits stay within 1e-5 of their range of the op-by-op batched step, which
computes the same layers with torch's norms, RoPE and SiLU (fp32 / bf16 weights; see that test for the GGUF).
Dense: the embedded SmolLM2 (Q4_1 GGUF blocks), tiny fp32 / bf16 Llama-family models (Qwen2's q/k/v biases, Qwen3's
per-head q/k norms) and a tiny Llama of mixed GGUF K-quant and Q5 blocks (stacked q; k; v and gate; up). MoE: the
tiny gpt-oss (sliding-window layers, sinks, MXFP4 experts with biases) at expert precision exact and q8. Hybrid
(`HybridDecoder.rows`): tiny Qwen3-MoE and GLM-4.5 (GQA + routed MoE), Kimi-Linear (KDA + MLA, bf16-born dense
experts), Qwen3-Next (Gated DeltaNet + gated GQA, shared-expert gate), Kimi K3 (attention residuals, latent MXFP4 MoE;
exact and q8), Kimi K2.5 (rotating MLA), DeepSeek-V3.2 (DSA's indexer) and GLM-5-Next (hyper-connections): the
delta-rule rows of a verify are consecutive tokens of one state, each row's state kept while the cache records. 16-token
cache blocks, so every run crosses blocks. The paged gpt-oss plan (a pager's experts called back per layer) has its
tests in tests/paging/test_moe_rows_paged.py."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu
from localmoe.kernels.decode_layers import DenseDecoder, GqaMoeDecoder
from localmoe.kernels.decode_layers.hybrid import HybridDecoder

from localmoe.config import EngineConfig
from localmoe.engine import batch
from localmoe.engine.generate import prefill
from localmoe.testing import write_checkpoint

pytestmark = [pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)"),
              pytest.mark.usefixtures("small_blocks")]

VOCAB = 97


def _tiny(model_type: str, dtype: str):
    """A tiny random Llama-family model (transformers' init, norms and biases perturbed) in `dtype`."""
    transformers = pytest.importorskip("transformers")
    from localmoe.load import build_from_tensors
    from localmoe.models import family_for_model_type

    config = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
              "qwen3": transformers.Qwen3Config}[model_type](
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        **({"head_dim": 16} if model_type == "qwen3" else {}))
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: p + 0.2 * torch.randn_like(p) if "norm" in name or name.endswith("bias") else p
               for name, p in reference.state_dict().items()}
    family = family_for_model_type(model_type)
    return build_from_tensors(family, family.spec_from_hf(config.to_dict()), tensors, family.hf_tensors,
                              EngineConfig(dtype=dtype, threads=1))


def _mixed_blocks():
    """A tiny Llama of GGUF blocks mixed as Q4_K_M / Q5_K_M files mix them (q, k Q4_K and v Q6_K: a stacked q; k; v;
    gate Q5_0 and up Q5_1: a stacked gate; up; o Q5_K, down Q6_K), random blocks."""
    import numpy as np
    from gguf import GGMLQuantizationType as Q

    from localmoe.engine.quantized import BlockQuantized
    from localmoe.load import build_from_tensors
    from localmoe.models import family_for_model_type
    from localmoe.testing.ggml_blocks import random_blocks

    transformers = pytest.importorskip("transformers")
    kinds = {"v_proj.weight": Q.Q6_K, "down_proj.weight": Q.Q6_K, "lm_head.weight": Q.Q6_K,
             "o_proj.weight": Q.Q5_K, "gate_proj.weight": Q.Q5_0, "up_proj.weight": Q.Q5_1}
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    tensors = dict(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).state_dict())
    rng = np.random.default_rng(0)
    for name, t in list(tensors.items()):
        if t.dim() == 2:
            kind = next((k for suffix, k in kinds.items() if name.endswith(suffix)), Q.Q4_K)
            tensors[name] = BlockQuantized(torch.from_numpy(random_blocks(kind, *t.shape, rng, step=(2e-4, 1e-3))),
                                           kind, tuple(t.shape))
    family = family_for_model_type("llama")
    model = build_from_tensors(family, family.spec_from_hf(config.to_dict()), tensors, family.hf_tensors,
                               EngineConfig(dtype="auto", threads=1))
    assert len(model.layers[0][1].qkv.segments) == 2 and len(model.layers[0][3].gate_up.segments) == 2
    return model


HYBRID = ["qwen3_moe", "glm4_moe", "kimi_linear", "qwen3_next", "kimi_k3", "kimi_k3-q8", "kimi_k25", "deepseek_v32",
          "glm5_next"]
MODELS = ["embedded", "embedded-q8all", "llama-fp32", "qwen2-bf16", "qwen3-fp32", "mixed-blocks", "gpt_oss-exact",
          "gpt_oss-q8", *HYBRID]


@pytest.fixture(scope="module", params=MODELS, ids=MODELS)
def model(request, tmp_path_factory):
    if request.param in HYBRID:
        from localmoe.load import load_model

        family, _, precision = request.param.partition("-")
        src = write_checkpoint(family, tmp_path_factory.mktemp(family), "tiny", seed=3)
        return load_model(src, EngineConfig(dtype="float32", threads=1, expert_precision=precision or "exact"),
                          progress=False).model
    if request.param.startswith("gpt_oss"):
        from localmoe.load import load_model

        src = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=0)
        return load_model(src, EngineConfig(dtype="float32", threads=1, expert_precision=request.param.split("-")[1]),
                          progress=False).model
    if request.param.startswith("embedded"):
        from localmoe.load import load_model

        # q8-all: the head's input rounded to int8 as well (engine/transformer.py _head), on both paths alike
        precision = "q8-all" if request.param.endswith("q8all") else "q8"
        return load_model(None, EngineConfig(threads=1, expert_precision=precision), progress=False).model
    if request.param == "mixed-blocks":
        return _mixed_blocks()
    kind, dtype = request.param.split("-")
    return _tiny(kind, {"fp32": "float32", "bf16": "bfloat16"}[dtype])


def _caches(model, n: int):
    """n batch-1 caches prefilled with prompts of 3 + 5 i tokens (different lengths, crossing blocks and gpt-oss's
    sliding window)."""
    vocab = model.spec.vocab_size
    caches = []
    for i in range(n):
        cache = model.new_cache(1, 200)
        prefill(model, torch.randint(0, vocab, (3 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
                cache)
        caches.append(cache)
    return caches


def _fused(model, tokens, caches) -> torch.Tensor:
    """Each token through the model's own single-sequence step (its fused plan), one after another."""
    with torch.inference_mode():
        return torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])


@pytest.fixture
def planned(monkeypatch):
    """Counts the rows the plans' `rows` run (so a test knows a plan, not the op-by-op step, ran)."""
    seen = []
    for plan in (DenseDecoder, GqaMoeDecoder, HybridDecoder):
        def rows(self, x, *args, run=plan.rows):
            seen.append(x.shape[0])
            return run(self, x, *args)

        monkeypatch.setattr(plan, "rows", rows)
    return seen


def test_the_model_decodes_through_its_plan(model):
    plan = batch.rows_plan(model)
    assert plan is not None
    if isinstance(plan.decoder, HybridDecoder):
        assert model.spec.family not in ("gpt_oss", "llama", "qwen2", "qwen3")
        return
    if model.spec.family != "gpt_oss":
        assert isinstance(plan.decoder, DenseDecoder)
        return
    assert isinstance(plan.decoder, GqaMoeDecoder)
    assert any(mixer.window for _, mixer, _, _ in model.layers) and model.layers[0][1].head_sinks is not None


@pytest.mark.parametrize("n", [1, 2, 5, 8, 16])
def test_rows_have_the_fused_step_bits(model, n, planned):
    fused, rows = _caches(model, n), _caches(model, n)
    tokens = [(7 + 11 * i) % model.spec.vocab_size for i in range(n)]
    for step in range(3):
        want = _fused(model, tokens, fused)
        got = batch.forward_rows(model, tokens, rows)
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item():.3e}"
        assert [c.offset for c in rows] == [c.offset for c in fused]
        tokens = want.argmax(-1).tolist()
    assert planned == [n] * 3


def test_a_sequence_on_several_rows_has_the_bits_of_its_steps_alone(model, planned):
    """Rows 1-3 are one sequence's three consecutive tokens (a verify, a prompt chunk) beside two others; only
    the rows in `wanted` give logits."""
    fused, rows = _caches(model, 3), _caches(model, 3)
    tokens = [5, 9, 14, 21, 30]
    on = [0, 1, 1, 1, 2]
    want = _fused(model, tokens, [fused[i] for i in on])
    got = batch.forward_rows(model, tokens, [rows[i] for i in on], wanted=[0, 3, 4])
    assert torch.equal(got, want[[0, 3, 4]])
    assert planned == [5]
    tokens = want[[0, 3, 4]].argmax(-1).tolist()  # and the next step reads what those rows wrote
    assert torch.equal(batch.forward_rows(model, tokens, rows), _fused(model, tokens, fused))


def test_a_prompt_chunk_past_one_call_has_the_bits_of_its_steps_alone(model, planned):
    """70 rows of one sequence (a prompt chunk: more rows than one GEMV call of the plan takes, matrix.h
    kMatrowsSlice, and than one exact MoE kernel call gives their alone-bits: an expert's group of over 32 tokens
    takes the shared-decode path, so the MoE plan cuts its experts into slices) beside a decoding one."""
    fused, rows = _caches(model, 2), _caches(model, 2)
    tokens = [(13 * i + 1) % model.spec.vocab_size for i in range(71)]
    on = [0] + [1] * 70
    want = _fused(model, tokens, [fused[i] for i in on])
    assert torch.equal(batch.forward_rows(model, tokens, [rows[i] for i in on]), want)
    assert planned == [71]


def test_greedy_with_prompt_lookup_equals_greedy_without(model, planned):
    """Speculation's verify runs the drafts as rows of the plan: the same tokens as plain decoding (the fused
    single-sequence step), token for token."""
    from localmoe.engine.generate import Decoder
    from localmoe.engine.sampler import SamplingParams
    from localmoe.engine.spec.drafters import PromptLookup
    from localmoe.engine.spec.speculator import Speculator

    prompt = [5, 17, 3, 99, 42, 7, 25, 11, 8, 5, 17, 3, 99, 42, 7, 25, 12, 5, 17, 3]
    prompt = [t % model.spec.vocab_size for t in prompt]

    def greedy(speculator) -> list[int]:
        dec = Decoder(model, prompt, SamplingParams(temperature=0.0), speculator=speculator)
        out: list[int] = []
        while len(out) < 24:
            logits = dec.logits()
            if logits is None:
                continue
            out.append(dec.sample(logits))
            dec.feed([out[-1]])
        return out

    plain = greedy(None)
    assert greedy(Speculator(PromptLookup(), k=4, adaptive=False)) == plain
    if model.spec.family != "glm5_next":  # (its tiny random model never repeats the prompt: nothing to draft; its
        # verify rows are test_a_sequence_on_several_rows_has_the_bits_of_its_steps_alone's)
        assert any(n > 1 for n in planned)  # a verify of several rows ran through the plan


def test_rows_stay_close_to_the_op_by_op_step(model, monkeypatch):
    """Not on the embedded GGUF: its block GEMVs round each input to int8 per 32 values, so the last-bit
    differences of torch's RoPE / SiLU flip a rounding somewhere and the flip grows through the layers (a
    step of real prompts: 1.2e-5 where nothing flipped, 0.58-0.70 of a logit range of 32-41 where something
    did; the fused single-sequence step differs from the op-by-op one by the same amounts). Its fused step,
    whose bits the rows have, is held to transformers by tests/models/test_smollm2_gguf.py."""
    if any(type(getattr(mixer, "qkv", None)).__name__ == "BlockLinear" for _, mixer, _, _ in model.layers):
        pytest.skip("int8-rounded activations: see the docstring")
    n = 8
    planned_caches, op_caches = _caches(model, n), _caches(model, n)
    tokens = [(3 + 5 * i) % model.spec.vocab_size for i in range(n)]
    got = batch.forward_rows(model, tokens, planned_caches)
    monkeypatch.setattr(batch, "rows_plan", lambda model: None)
    want = batch.forward_rows(model, tokens, op_caches)
    spread = (want.max(-1).values - want.min(-1).values).min().item()
    err = (got - want).abs().max().item()
    assert err <= 1e-5 * spread, f"max |diff| {err:.3e} against a logit range of {spread:.3e}"


OTHER_ISAS = [name for name in _cpu.supported_isas() if name != "avx2"] if _cpu.library() is not None else []


@pytest.mark.skipif(not OTHER_ISAS, reason="this CPU runs the AVX2 kernels only")
@pytest.mark.parametrize("isa", OTHER_ISAS)
def test_rows_have_the_same_bits_on_every_isa(model, isa):
    results = []
    for name in ("avx2", isa):
        with _cpu.forced_isa(name):
            caches = _caches(model, 5)
            tokens = [(2 + 3 * i) % model.spec.vocab_size for i in range(5)]
            results.append(torch.cat([batch.forward_rows(model, tokens, caches),
                                      batch.forward_rows(model, tokens[::-1], caches)]))
    assert torch.equal(results[0], results[1]), f"max |diff| {(results[0] - results[1]).abs().max().item():.3e}"
