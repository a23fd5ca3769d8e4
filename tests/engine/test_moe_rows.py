"""MoE rows bit-independent (engine/batch.py `rows_independent`, `row_limit`; engine/layers/moe.py
`MoEBlock.independent_rows`): a MoE model's prompt tokens run as rows of the batched step give the same bits in
any chunking and beside any other rows, so the worker runs MoE prompts as rows and each routed expert is read once
per step for the decode rows and the prompt rows together. Before, a chunk past 96 rows routed through torch's
GEMM (its bits depend on the call's rows), an exact MXFP4 expert's group of 9+ tokens took the kernel's fp32 path
(summation order by group size), and a model with a MoE block never ran prompts as rows."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.batch import MOE_MIN_ROWS, forward_rows, row_limit, rows_independent
from localmoe.engine.experts import DENSE_MAX_TOKENS
from localmoe.kernels import _cpu
from localmoe.kernels.mxfp4_moe import EXACT_TOKEN_ROWS, EXPERT_GEMV_MAX_TOKENS, GEMV_MAX_TOKENS
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")

PROMPT = 150


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    from localmoe.testing.moe_gguf import write_moe_gguf

    root = tmp_path_factory.mktemp("moe_rows")
    out = {family: write_checkpoint(family, root / family, "tiny", seed=0) for family in ("gpt_oss", "qwen3_moe")}
    out["qwen3_moe gguf"] = write_moe_gguf(out["qwen3_moe"], root / "qwen3_moe.q4_k_m.gguf", "q4_k_m")
    return out


def _load(path, precision: str):
    return load_model(path, EngineConfig(dtype="float32", threads=1, expert_precision=precision), progress=False).model


def _chunked(model, prompt: list[int], chunk: int, beside: list[int] | None = None) -> torch.Tensor:
    """The prompt's logits at every position, run as rows of `forward_rows` in chunks of `chunk` tokens, after
    another sequence's rows (`beside`: one of its tokens per step, a decoding neighbour) where given."""
    cache, other = model.new_cache(1, 512), model.new_cache(1, 512)
    out = []
    for step, at in enumerate(range(0, len(prompt), chunk)):
        part = prompt[at:at + chunk]
        lead = [] if beside is None else [beside[step % len(beside)]]
        logits = forward_rows(model, lead + part, [other] * len(lead) + [cache] * len(part))
        out.append(logits[len(lead):])
    return torch.cat(out)


@pytest.mark.parametrize("family,precision", [("gpt_oss", "q8"), ("gpt_oss", "exact"), ("qwen3_moe", "q8"),
                                              ("qwen3_moe gguf", "q8")],
                         ids=["gpt_oss-q8", "gpt_oss-exact", "qwen3_moe-dense", "qwen3_moe-q4_k_m"])
def test_moe_prompt_rows_do_not_depend_on_the_chunking(checkpoints, family, precision):
    """Chunks of 1 .. `row_limit` rows (and past it: forward_rows cuts the MoE calls), alone or beside a
    decoding sequence's row, give every prompt position the bits it has one token at a time."""
    model = _load(checkpoints[family], precision)
    limit = row_limit(model)
    expected = {"gpt_oss": {"q8": EXPERT_GEMV_MAX_TOKENS, "exact": EXACT_TOKEN_ROWS}[precision],
                "qwen3_moe": DENSE_MAX_TOKENS, "qwen3_moe gguf": GEMV_MAX_TOKENS}[family]
    assert limit == expected and rows_independent(model)
    rng = random.Random(1)
    prompt = [rng.randrange(3, model.spec.vocab_size) for _ in range(PROMPT)]
    one = _chunked(model, prompt, 1)
    for chunk in (2, 7, 16, 31, 64, 97, PROMPT):
        assert torch.equal(_chunked(model, prompt, chunk), one), chunk
    beside = [rng.randrange(3, model.spec.vocab_size) for _ in range(PROMPT)]
    assert torch.equal(_chunked(model, prompt, 15, beside), one)


def test_group_limited_routing_is_not_admitted(checkpoints):
    """A router with group-limited top-k (torch over the whole call) gives no row its own bits: such a model's
    prompts keep their own forward."""
    model = _load(checkpoints["gpt_oss"], "q8")
    block = model.moe_blocks()[0]
    assert block.independent_rows >= MOE_MIN_ROWS
    plain = block.router
    grouped = copy.copy(plain)  # a router is built with its rule: a new one, as a model with such routing has
    rule = plain.rule
    grouped.rule = type(rule)(rule.top_k, rule.scoring, rule.renormalize, rule.scaling, 2, 1)
    block.router = grouped
    try:
        assert block.independent_rows == 0 and not rows_independent(model)
    finally:
        block.router = plain
    assert block.independent_rows >= MOE_MIN_ROWS


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("O,K", [(1536, 2048), (67, 2051), (5, 40)], ids=lambda v: str(v))
def test_a_linear_takes_a_steps_rows_in_one_kernel_call(dtype, O, K):
    """Inside a batched step a dense `Linear` runs up to DECODE_ROWS rows in one kernel call (register tiles of
    rows x outputs, the weight read once for all), every row with the bits it has alone (output and column counts
    off the tiles' multiples included); outside a step more than GEMV_MAX_ROWS rows take torch's GEMM."""
    from localmoe.engine.linear import DECODE_ROWS, Linear
    from localmoe.engine.quantized import decode_rows
    from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS

    g = torch.Generator().manual_seed(O + K)
    linear = Linear(torch.randn(O, K, generator=g), torch.randn(O, generator=g), dtype)
    x = torch.randn(DECODE_ROWS, K, generator=g)
    assert linear.independent_rows == GEMV_MAX_ROWS
    with torch.inference_mode(), decode_rows():
        assert linear.independent_rows == DECODE_ROWS
        alone = torch.cat([linear(x[n:n + 1]) for n in range(DECODE_ROWS)])
        for N in (2, 3, 7, 9, 16, 33, DECODE_ROWS):
            assert torch.equal(linear(x[:N]), alone[:N]), N
    close = torch.allclose(alone, x @ linear.weight.float().T + linear.bias, rtol=1e-4, atol=1e-3)
    assert close, (alone - x @ linear.weight.float().T - linear.bias).abs().max()
