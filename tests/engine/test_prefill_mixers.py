"""The CPU prefill of the mixers (kernels/decode_layers/hybrid_prefill.cpp through kernels/kda/native.py and
kernels/mla_decode/native.py: everything between a KDA / Gated DeltaNet / MLA layer's projections in one C++ call, the
fused decode step's arithmetic per token) against the op-by-op layers, on tiny Kimi-Linear, Qwen3-Next and Kimi K3
(KDA with the bounded gate): every prompt position's logits, then greedy decode steps, within 1e-5 of the logit
range."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.layers import gated_deltanet, kda, mla
from localmoe.kernels import _cpu
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

pytestmark = pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")

PROMPT = list(range(3, 70))


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3_next", "kimi_k3"])
def model(request, tmp_path_factory):
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), size="tiny", seed=4)
    return load_model(path, EngineConfig(dtype="float32", max_context=96), progress=False).model


def _logits(model, chunks: list[int]) -> torch.Tensor:
    """Every prompt position's logits (the prompt in `chunks`), then 4 greedy steps' [len(PROMPT) + 4, V]."""
    cache = model.new_cache(1, 96)
    rows, start = [], 0
    for n in chunks:
        rows.append(model.forward(torch.tensor([PROMPT[start:start + n]]), cache, all_logits=True)[0])
        start += n
    for _ in range(4):
        rows.append(model.forward(rows[-1][-1:].argmax(-1).view(1, 1), cache)[0])
    return torch.cat(rows).float()


def test_native_mixers_match_op_by_op(model, monkeypatch):
    calls = []
    native = ((kda, "kda_chunk", "mixer_available"), (gated_deltanet, "gdn_chunk", "mixer_available"),
              (mla, "mla_chunk", "chunk_available"))
    for module, name, _ in native:
        chunk = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, name=name, chunk=chunk, **k: calls.append(name) or chunk(*a, **k))
    got = [_logits(model, chunks) for chunks in ([len(PROMPT)], [40, 1, 26])]
    assert calls, "the C++ prefill mixers did not run"
    assert ("mla_chunk" in calls) == (model.spec.mla is not None), "MLA's prefill call did not run"
    for module, _, available in native:
        monkeypatch.setattr(module, available, lambda *a: False)
    want = _logits(model, [len(PROMPT)])
    scale = want.amax(-1) - want.amin(-1)
    for g in got:
        err = ((g - want).abs().amax(-1) / scale).max().item()
        assert err < 1e-5, f"C++ prefill mixers differ from op by op by {err:.2e} of the logit range"
