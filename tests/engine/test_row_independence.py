"""A row's result does not depend on the other rows of a call (engine/batch.py): every matrix, MLP, MoE
block and lm_head of a model, called on N <= GEMV_MAX_ROWS decode rows, gives each row the bits it has
alone. Batched decoding of several sequences and speculative verification (engine/spec) rely on it for
"batched greedy == alone". It failed at `small` shapes while tiny ones hid it: the dense GEMV kernel
summed a token's dot in an order that depended on the call's row count (3-4 and 5-8 rows took fewer
accumulators), and `Linear` handed calls past 16 KiB of x (6+ rows of 768 columns) to torch's GEMM
(bf16 weights: x rounded to bf16); with exact MXFP4 experts, an expert's 2+ tokens took another path than one.
"""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels import _cpu, dense_gemv
from localmoe.kernels._cpu import small_steps
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS

from localmoe.config import EngineConfig
from localmoe.engine.layers.mlp import GatedMLP
from localmoe.engine.layers.moe import MoEBlock
from localmoe.engine.linear import Linear
from localmoe.engine.quantized import BlockLinear, decode_rows
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

needs_cpu_kernel = pytest.mark.skipif(_cpu.library() is None, reason="CPU kernel unavailable (no AVX2 or compiler)")


def _calls(model):
    """(name, fn, input width) of the lm_head and of every matrix, MLP and MoE block of every layer."""
    yield "lm_head", model.lm_head, model.spec.hidden_size
    for i, layer in enumerate(model.layers):
        for part in layer:
            for name, fn in [("", part), *vars(part).items()] if hasattr(part, "__dict__") else [("", part)]:
                where = f"layer {i} {type(part).__name__}.{name}".rstrip(".")
                if isinstance(fn, (Linear, BlockLinear)):
                    yield where, fn, fn.weight.shape[1] if isinstance(fn, Linear) else fn.in_features
                elif isinstance(fn, (MoEBlock, GatedMLP)):
                    yield where, fn, model.spec.hidden_size


def _differing(fn, K: int, seed: int) -> dict[int, float]:
    """{N: max |difference|} over N = 2..GEMV_MAX_ROWS where N decode rows of x [N, 1, K] in one call differ
    from the same rows one call each (empty: every row has its own bits)."""
    x = torch.randn(GEMV_MAX_ROWS, 1, K, generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode(), small_steps(), decode_rows():
        alone = torch.cat([fn(x[n:n + 1]) for n in range(GEMV_MAX_ROWS)])
        got = {N: (fn(x[:N]) - alone[:N]).abs().max().item() for N in range(2, GEMV_MAX_ROWS + 1)}
    return {N: diff for N, diff in got.items() if diff != 0}


@needs_cpu_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("K", [8, 64, 77, 768, 2880], ids=lambda k: f"K{k}")
def test_dense_gemv_rows_have_their_own_bits(K, dtype):
    """The kernel: each of N = 1..11 tokens (past a group of 8 too) gets the bits it gets alone, for widths
    with and without 32-, 8- and 1-column tails."""
    g = torch.Generator().manual_seed(K)
    x, w, bias = torch.randn(11, K, generator=g), torch.randn(37, K, generator=g).to(dtype), torch.randn(37, generator=g)
    alone = torch.cat([dense_gemv.dense_gemv(x[n:n + 1], w, bias) for n in range(11)])
    for N in range(2, 12):
        assert torch.equal(dense_gemv.dense_gemv(x[:N], w, bias), alone[:N]), f"{N} rows of K={K} {dtype}"


def _assert_rows_independent(model, moe: bool) -> None:
    """Every call of `model` (`moe`: its MoE blocks only, else all the others) keeps rows independent."""
    calls = [(name, fn, K) for name, fn, K in _calls(model) if isinstance(fn, MoEBlock) == moe]
    assert calls or moe
    failures = {name: diff for seed, (name, fn, K) in enumerate(calls) if (diff := _differing(fn, K, seed))}
    assert not failures, f"rows of one call differ from the same rows alone (N: max abs): {failures}"


def test_every_matrix_of_a_tiny_model_keeps_rows_independent(model):
    _assert_rows_independent(model, moe=False)


def test_every_moe_block_of_a_tiny_model_keeps_rows_independent(model):
    """expert_precision "exact" (these models' config): an MXFP4 expert's group of 2-8 tokens took the kernel's
    fp32 path (mxfp4_rows.h row_f32, summation order by group size) where one token takes the integer path."""
    _assert_rows_independent(model, moe=True)


@needs_cpu_kernel
def test_every_call_of_a_small_gpt_oss_keeps_rows_independent(tmp_path):
    """At gpt-oss `small` shapes (hidden 768, fp32): 6 rows of lm_head, q/k/v and o_proj took torch's GEMM and
    3+ rows the kernel's other summation orders (up to 1e-2 apart with bf16 weights, 5e-7 in fp32)."""
    path = write_checkpoint("gpt_oss", tmp_path, "small", seed=0)
    model = load_model(path, EngineConfig(dtype="float32", threads=1), progress=False).model
    _assert_rows_independent(model, moe=False)
    _assert_rows_independent(model, moe=True)  # expert_precision "q8" (the default): one path per token


@pytest.mark.parametrize("D", [768, 2048])
def test_attention_residual_mix_rows_have_their_own_bits(D):
    """K3's depth mix (engine/layers/attn_res.py) over N decode rows, for 1..12 stored entries: each row as
    alone. Its prefill form (a matmul and an einsum over the call) sums in an order that depends on N."""
    from localmoe.engine.layers.attn_res import depth_mix

    for entries in range(1, 13):
        g = torch.Generator().manual_seed(D + entries)
        values = [torch.randn(GEMV_MAX_ROWS, 1, D, generator=g) * (i + 1) for i in range(entries)]
        query = torch.randn(D, generator=g)
        alone = torch.cat([depth_mix([v[n:n + 1] for v in values], query, 1e-6) for n in range(GEMV_MAX_ROWS)])
        for N in range(2, GEMV_MAX_ROWS + 1):
            assert torch.equal(depth_mix([v[:N] for v in values], query, 1e-6), alone[:N]), (entries, N)
