"""The hybrid decode plan's rows over a pager (kernels/decode_layers/hybrid.py `HybridDecoder.rows`, a paged layer's
experts called back once per layer for all rows: engine/decode_plan.py `_routed`, the rows' union held together): a
row has the bits of the fused single-sequence step, paged or resident. 16 sequences of Kimi K3 (MXFP4 experts under
a latent MoE, attention residuals, MLA + KDA) and Kimi-Linear (bf16 experts) at 25% of the experts and at one slot per
layer equal the resident model's fused steps bit for bit, and so does a verify (one sequence on several rows)."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine import batch
from localmoe.engine.generate import prefill
from localmoe.kernels.decode_layers.hybrid import HybridDecoder

from .test_moe_rows_paged import _paged

N = 16


def _caches(model, n: int):
    vocab = model.spec.vocab_size
    caches = []
    for i in range(n):
        cache = model.new_cache(1, 120)
        prefill(model, torch.randint(0, vocab, (3 + 4 * i,), generator=torch.Generator().manual_seed(i)).tolist(),
                cache)
        caches.append(cache)
    return caches


def _steps(model, rows: bool, steps: int = 3) -> torch.Tensor:
    """Logits of `steps` greedy steps of N sequences (as rows of the batched step, or each token alone), then a
    verify of sequence 0's next token and three more (its rows, or its tokens one at a time)."""
    caches = _caches(model, N)
    tokens = [(7 + 11 * i) % model.spec.vocab_size for i in range(N)]
    out = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = batch.forward_rows(model, tokens, caches) if rows else \
                torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])
            out.append(logits)
            tokens = logits.argmax(-1).tolist()
        verify = [tokens[0], 3, 14, 15]
        logits = batch.forward_rows(model, verify, [caches[0]] * 4) if rows else \
            torch.cat([model.forward(torch.tensor([[t]]), caches[0])[:, -1] for t in verify])
    return torch.cat([torch.cat(out), logits])


@pytest.mark.parametrize("family", ["kimi_k3", "kimi_linear"])
@pytest.mark.parametrize("share", ["1-per-layer", "25%"])
def test_paged_rows_equal_resident_fused_steps(ckpts, family, share):
    c = ckpts[family]
    resident = _steps(c.model, rows=False)
    try:
        pager = _paged(c, share)
        plan = batch.rows_plan(c.model)
        assert plan is not None and isinstance(plan.decoder, HybridDecoder)
        moe = [layer for layer in plan.decoder.layers if layer.moe]
        assert moe and all(not layer.table and not layer.dense for layer in moe)  # every layer's experts called back
        rows = _steps(c.model, rows=True)
        fused = _steps(c.model, rows=False)
        pager.close()
    finally:
        c.restore()
    assert torch.equal(rows, resident), f"max |diff| {(rows - resident).abs().max().item():.3e}"
    assert torch.equal(fused, resident), f"max |diff| {(fused - resident).abs().max().item():.3e}"
