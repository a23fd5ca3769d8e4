"""The decode plans over bf16 / fp8 K/V caches (`--kv-cache-dtype`), read and written in their own dtype
(kernels/fp8_cache cache_rows.h: the engine's rounding and exact ring of the newest positions): the dense and gpt-oss
forms' fused one-token step (`decode_dense` / `decode_gqa_moe` through a layer's `keys` / `values` views) and their
rows (`decode_dense_rows` / `decode_gqa_moe_rows`: kernels/gqa_decode paged_cpu.cpp's cached rows), beside the
hybrid form (Qwen3-MoE), which already read them. Every row of a batched step has the bits the fused single-sequence
step gives its sequence alone (1 and 16 sequences, and a sequence on several rows: a verify, whose rows run in turns
so that the ring holds for each row what it holds alone); the fused step stays within 1e-5 of the logit range of the
op-by-op step over the same cache dtype, and so do the rows of the op-by-op batched step; AVX2 == AVX-512. Prompts of
40-75 tokens: every sequence has positions past the 32-row exact ring (rounded rows are read) and crosses 16-token
blocks. Models: a tiny Llama shaped as the embedded SmolLM2's attention (9 query heads, 3 KV heads of 64), the
embedded model itself (Q4_1 blocks), a tiny Qwen3 (q/k norms), the tiny gpt-oss (sliding windows, sinks, MXFP4
experts) and the tiny Qwen3-MoE."""

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
from localmoe.testing.parity import kv_cache_dtype

pytestmark = [pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)"),
              pytest.mark.usefixtures("small_blocks")]

VOCAB = 97
MODELS = ["smollm-shaped", "embedded", "qwen3", "gpt_oss", "qwen3_moe"]
DTYPES = ["bfloat16", "fp8"]


def _tiny(model_type: str, **shape):
    transformers = pytest.importorskip("transformers")
    from localmoe.load import build_from_tensors
    from localmoe.models import family_for_model_type

    config = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[model_type](
        vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=256, rms_norm_eps=1e-5,
        tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {name: p + 0.2 * torch.randn_like(p) if "norm" in name else p
               for name, p in reference.state_dict().items()}
    family = family_for_model_type(model_type)
    return build_from_tensors(family, family.spec_from_hf(config.to_dict()), tensors, family.hf_tensors,
                              EngineConfig(dtype="float32", threads=1))


@pytest.fixture(scope="module", params=MODELS, ids=MODELS)
def model(request, tmp_path_factory):
    from localmoe.load import load_model

    if request.param == "smollm-shaped":
        return _tiny("llama", hidden_size=576, intermediate_size=96, num_attention_heads=9, num_key_value_heads=3)
    if request.param == "qwen3":
        return _tiny("qwen3", hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=16)
    if request.param == "embedded":
        return load_model(None, EngineConfig(threads=1), progress=False).model
    src = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny", seed=3)
    return load_model(src, EngineConfig(dtype="float32", threads=1), progress=False).model


@pytest.fixture(params=DTYPES)
def lossy(model, request):
    with kv_cache_dtype(model, request.param):
        yield request.param


def _caches(model, n: int):
    """n batch-1 caches prefilled with prompts of 40 + 7 i tokens (past the exact ring, across blocks)."""
    caches = []
    for i in range(n):
        cache = model.new_cache(1, 200)
        prompt = torch.randint(0, model.spec.vocab_size, (40 + 7 * (i % 6),), generator=torch.Generator().manual_seed(i))
        prefill(model, prompt.tolist(), cache)
        caches.append(cache)
    return caches


def _fused(model, tokens, caches) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])


@pytest.fixture
def planned(monkeypatch):
    """Counts the rows the plans' `rows` run and the fused single-sequence steps the plans' decoders run."""
    seen = {"rows": [], "fused": 0}
    for plan in (DenseDecoder, GqaMoeDecoder, HybridDecoder):
        def rows(self, x, *args, run=plan.rows):
            seen["rows"].append(x.shape[0])
            return run(self, x, *args)

        def call(self, *args, run=plan.__call__):
            seen["fused"] += 1
            return run(self, *args)

        monkeypatch.setattr(plan, "rows", rows)
        monkeypatch.setattr(plan, "__call__", call)
    return seen


def test_the_caches_are_lossy_and_read_as_such(model, lossy):
    """The cache holds rounded rows (bf16 / fp8 pools), and the plan's logits differ from an fp32 cache's."""
    caches = _caches(model, 1)
    assert caches[0].layers[0].keys.pool.dtype == {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn}[lossy]
    with kv_cache_dtype(model, "float32"):
        exact = _caches(model, 1)
    assert not torch.equal(_fused(model, [5], caches), _fused(model, [5], exact))


@pytest.mark.parametrize("n", [1, 16])
def test_rows_have_the_fused_step_bits(model, lossy, n, planned):
    fused, rows = _caches(model, n), _caches(model, n)
    tokens = [(7 + 11 * i) % model.spec.vocab_size for i in range(n)]
    for step in range(3):
        want = _fused(model, tokens, fused)
        got = batch.forward_rows(model, tokens, rows)
        assert torch.equal(got, want), f"step {step}: max |diff| {(got - want).abs().max().item():.3e}"
        tokens = want.argmax(-1).tolist()
    assert planned["rows"] == [n] * 3
    assert planned["fused"] == 3 * n  # every single-sequence step ran fused (not op by op)


def test_a_sequence_on_several_rows_has_the_bits_of_its_steps_alone(model, lossy, planned):
    """Rows 1-5 are one sequence's five consecutive tokens (a verify) beside two others: each row reads the exact
    ring as its token alone does, though the later rows' writes take the slots of its oldest exact positions."""
    fused, rows = _caches(model, 3), _caches(model, 3)
    tokens = [5, 9, 14, 21, 30, 33, 41]
    on = [0, 1, 1, 1, 1, 1, 2]
    want = _fused(model, tokens, [fused[i] for i in on])
    got = batch.forward_rows(model, tokens, [rows[i] for i in on])
    assert torch.equal(got, want), f"max |diff| {(got - want).abs().max().item():.3e}"
    assert planned["rows"] == [7]
    tokens = want[[0, 5, 6]].argmax(-1).tolist()  # and the next step reads what those rows wrote
    assert torch.equal(batch.forward_rows(model, tokens, rows), _fused(model, tokens, fused))


def test_the_plans_stay_close_to_the_op_by_op_step(model, lossy, monkeypatch, planned):
    """The fused one-token step and the rows against the op-by-op steps over the same cache dtype (torch's norms,
    RoPE, SiLU, quantisation and dequantisation): within 1e-5 of the logit range. Not on the embedded GGUF (int8-
    rounded activations: tests/engine/test_rows_plan.py `test_rows_stay_close_to_the_op_by_op_step`)."""
    if any(type(getattr(mixer, "qkv", None)).__name__ == "BlockLinear" for _, mixer, _, _ in model.layers):
        pytest.skip("int8-rounded activations")
    n = 6
    fused, rows = _caches(model, n), _caches(model, n)
    tokens = [(3 + 5 * i) % model.spec.vocab_size for i in range(n)]
    got_fused, got_rows = _fused(model, tokens, fused), batch.forward_rows(model, tokens, rows)
    assert planned["fused"] == n and planned["rows"] == [n]
    monkeypatch.setattr(type(model), "_planned_step", lambda self, tokens, cache: None)
    monkeypatch.setattr(batch, "rows_plan", lambda model: None)
    op_fused, op_rows = _caches(model, n), _caches(model, n)
    want_fused, want_rows = _fused(model, tokens, op_fused), batch.forward_rows(model, tokens, op_rows)
    assert planned["fused"] == n and planned["rows"] == [n]  # the op-by-op steps ran
    for got, want in ((got_fused, want_fused), (got_rows, want_rows)):
        spread = (want.max(-1).values - want.min(-1).values).min().item()
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * spread, f"max |diff| {err:.3e} against a logit range of {spread:.3e}"


OTHER_ISAS = [name for name in _cpu.supported_isas() if name != "avx2"] if _cpu.library() is not None else []


@pytest.mark.skipif(not OTHER_ISAS, reason="this CPU runs the AVX2 kernels only")
@pytest.mark.parametrize("isa", OTHER_ISAS)
def test_the_same_bits_on_every_isa(model, lossy, isa):
    results = []
    for name in ("avx2", isa):
        with _cpu.forced_isa(name):
            caches = _caches(model, 4)
            tokens = [(2 + 3 * i) % model.spec.vocab_size for i in range(4)]
            results.append(torch.cat([batch.forward_rows(model, tokens, caches),
                                      batch.forward_rows(model, tokens[:1] * 3, caches[:1] * 3),
                                      _fused(model, tokens, caches)]))
    assert torch.equal(results[0], results[1]), f"max |diff| {(results[0] - results[1]).abs().max().item():.3e}"
