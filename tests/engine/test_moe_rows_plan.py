"""The gpt-oss decode plan over many rows (kernels/decode_layers `decode_gqa_moe_rows`, engine/batch.py
`forward_rows` through `rows_plan`): every row of a batched step has the bits the fused single-sequence step
(`decode_gqa_moe`, what `localmoe run` decodes with) gives its token alone, for 1, 2, 5, 8 and 16 sequences of
different lengths (sliding-window layers, sinks, MXFP4 experts with biases), for a sequence on several rows (a
speculative verify), for a prompt chunk past one MoE kernel call's row limit (EXACT_TOKEN_ROWS), at expert
precision exact and q8, and on the AVX2 and AVX-512 builds; a greedy run with a prompt-lookup speculator
gives the tokens of the run without. The paged form (a pager's experts called back per layer) has its tests in
tests/paging/test_moe_rows_paged.py."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu
from localmoe.kernels.decode_layers import GqaMoeDecoder

from localmoe.config import EngineConfig
from localmoe.engine import batch
from localmoe.engine.generate import prefill
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

pytestmark = [pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)"),
              pytest.mark.usefixtures("small_blocks")]


@pytest.fixture(scope="module", params=["exact", "q8"])
def model(request, tmp_path_factory):
    src = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=0)
    return load_model(src, EngineConfig(dtype="float32", threads=1, expert_precision=request.param),
                      progress=False).model


def _caches(model, n: int, first: int = 3):
    """n batch-1 caches prefilled with prompts of first + 5 i tokens (different lengths, past the sliding window
    and across cache blocks)."""
    vocab = model.spec.vocab_size
    caches = []
    for i in range(n):
        cache = model.new_cache(1, 200)
        prefill(model, torch.randint(0, vocab, (first + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
                cache)
        caches.append(cache)
    return caches


def _fused(model, tokens, caches) -> torch.Tensor:
    """Each token through the model's own single-sequence step (its fused plan), one after another."""
    with torch.inference_mode():
        return torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])


@pytest.fixture
def planned(monkeypatch):
    """Counts the rows `GqaMoeDecoder.rows` runs (so a test knows the plan, not the op-by-op step, ran)."""
    seen = []
    run = GqaMoeDecoder.rows

    def rows(self, x, *args):
        seen.append(x.shape[0])
        return run(self, x, *args)

    monkeypatch.setattr(GqaMoeDecoder, "rows", rows)
    return seen


def test_the_model_decodes_through_the_gpt_oss_plan(model):
    plan = batch.rows_plan(model)
    assert plan is not None and isinstance(plan.decoder, GqaMoeDecoder)
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
    """Rows 1-3 are one sequence's three consecutive tokens (a verify) beside two others; only the rows in
    `wanted` give logits."""
    fused, rows = _caches(model, 3), _caches(model, 3)
    tokens = [5, 9, 14, 21, 30]
    on = [0, 1, 1, 1, 2]
    want = _fused(model, tokens, [fused[i] for i in on])
    got = batch.forward_rows(model, tokens, [rows[i] for i in on], wanted=[0, 3, 4])
    assert torch.equal(got, want[[0, 3, 4]])
    assert planned == [5]
    tokens = want[[0, 3, 4]].argmax(-1).tolist()  # and the next step reads what those rows wrote
    assert torch.equal(batch.forward_rows(model, tokens, rows), _fused(model, tokens, fused))


def test_a_prompt_chunk_past_one_moe_call_has_the_bits_of_its_steps_alone(model, planned):
    """70 rows of one sequence beside a decoding one: more rows than one exact MoE kernel call gives their
    alone-bits (an expert's group of over 32 tokens takes the shared-decode path), so the plan cuts the MoE into
    slices; the attention and matrices take all 71 at once."""
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
    assert any(n > 1 for n in planned)  # a verify of several rows ran through the plan


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
