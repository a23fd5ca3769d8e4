"""The batched decode step's attention (engine/batch.py `_gqa`): every row's cache write and GQA attention
in one kernel call over the sequences' paged caches (kernels/gqa_decode `gqa_decode_rows`, every layer's rows
prepared once per step) gives the
same bits as the per-sequence path it replaced (cache.update, then gqa_decode on the read keys), which
stays the fallback for caches the kernel cannot write in place (bf16/fp8 rows). Tiny gpt-oss (sliding
windows, sinks) and Qwen3-MoE (q/k norms), caches in 4-token blocks so the rows cross blocks, a sequence
on two consecutive rows (a speculative verify), sequences of different lengths. gpt-oss's rows normally run in its
C++ rows plan (tests/engine/test_rows_plan.py); here the plan is switched off, so its rows take this step, as they
do wherever the plan does not apply."""

from __future__ import annotations

import pytest
import torch
from localmoe.kernels.gqa_decode import cpu

from localmoe.config import EngineConfig
from localmoe.engine import batch
from localmoe.engine import cache as cache_module
from localmoe.engine.batch import forward_rows
from localmoe.engine.cache import KVCache, ModelCache
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

FAMILIES = ["gpt_oss", "qwen3_moe"]


@pytest.fixture(scope="module", params=FAMILIES, ids=FAMILIES)
def model(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny", seed=1)
    return load_model(path, EngineConfig(dtype="float32", threads=1, expert_precision="exact"), progress=False).model


def _run(model, prompts, steps: int, dtype: str = "float32"):
    """Logits of `steps` batched decode steps (greedy) after prefilling each prompt into its own cache of
    `dtype` rows; the last row each step repeats the first sequence at its next position (rows sharing a
    cache)."""
    caches = [ModelCache([mixer.new_cache(1, 64, dtype) for _, mixer, _, _ in model.layers], 1, 64) for _ in prompts]
    tokens = [int(model.forward(torch.tensor([p]), c)[0, -1].argmax()) for p, c in zip(prompts, caches)]
    out = []
    for _ in range(steps):
        logits = forward_rows(model, tokens + [tokens[0]], caches + [caches[0]])
        out.append(logits)
        tokens = logits[:-1].argmax(-1).tolist()
        tokens[0] = int(logits[-1].argmax())  # the first sequence went two positions ahead
        caches[0].trim(caches[0].offset - 1)  # keep one of its two: the next step writes that position again
    return torch.stack(out), caches


def test_one_kernel_call_equals_the_per_sequence_path(model, monkeypatch):
    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 4)
    monkeypatch.setattr(batch, "rows_plan", lambda model: None)  # the Python step's attention, not a plan's
    prompts = [[3, 5, 7], [11] * 9, [2, 4, 6, 8, 10, 12, 14], [9]]
    with torch.inference_mode():
        got, caches = _run(model, prompts, 10)
        calls = []
        monkeypatch.setattr(cpu, "gqa_decode_rows", lambda *a, **k: calls.append(1) or _real(*a, **k))
        _run(model, prompts[:2], 1)
        assert calls or cpu.library() is None  # the batched kernel ran
        monkeypatch.setattr(KVCache, "pages", lambda self, pos: None)  # every layer: the per-sequence path
        want, want_caches = _run(model, prompts, 10)
    if cpu.library() is not None:
        assert torch.equal(got, want)  # the same instructions per (row, head) over the same keys
        for a, b in zip(caches, want_caches):
            for la, lb in zip(a.layers, b.layers):
                if isinstance(la, KVCache):
                    assert torch.equal(la.keys.read(a.offset), lb.keys.read(b.offset))
                    assert torch.equal(la.values.read(a.offset), lb.values.read(b.offset))
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


_real = cpu.gqa_decode_rows


def test_lossy_caches_take_the_per_sequence_path(model):
    """bf16 rows cannot be written in place: `pages` declines and the step still runs (fallback path)."""
    with torch.inference_mode():
        logits, caches = _run(model, [[1, 2, 3], [4]], 2, dtype="bfloat16")
    assert any(isinstance(layer, KVCache) for layer in caches[0].layers)
    assert all(layer.pages(0) is None for c in caches for layer in c.layers if isinstance(layer, KVCache))
    assert torch.isfinite(logits).all()
