"""The fused decode plans over a pager (kernels/decode_layers: gpt-oss's GqaMoeDecoder and the hybrid plan's
HybridDecoder, with layers whose experts are called back once per layer for all rows: engine/decode_plan.py
`_paged_experts`, `_routed`): the single-sequence step and the batched step's rows both run the plan, and a row has
the bits of the fused single-sequence step, paged or resident. 16 sequences of gpt-oss (MXFP4 experts, sliding
windows, sinks), Kimi K3 (MXFP4 experts under a latent MoE, attention residuals, MLA + KDA) and Kimi-Linear (bf16
experts) at 25% of the experts and at one slot per layer equal the resident model's fused steps bit for bit, and so
does a verify (one sequence on several rows)."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine import batch
from localmoe.engine.generate import prefill
from localmoe.kernels.decode_layers import GqaMoeDecoder
from localmoe.kernels.decode_layers.hybrid import HybridDecoder
from localmoe.paging import PagingConfig, attach, expert_bytes, make_pager

N = 16


def _paged(c, share: str):
    store = c.store()
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    budget = len(store.layers()) * slot if share == "1-per-layer" else max(1, expert_bytes(store) // 4 // slot) * slot
    pager = make_pager(store, PagingConfig(ram_budget=budget, policy="lru", io="odirect", prefetch=True, timeout=10))
    c.model.use_experts(pager)
    attach(c.model, pager, lookahead=True)
    return pager


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


def _all_called_back(decoder) -> bool:
    """Whether every MoE layer of the plan calls its experts back (no resident table)."""
    if isinstance(decoder, GqaMoeDecoder):
        return all(layer.table is None for layer in decoder.layers)
    moe = [layer for layer in decoder.layers if layer.moe]
    return bool(moe) and all(not layer.table and not layer.dense for layer in moe)


@pytest.mark.parametrize("family", ["gpt_oss", "kimi_k3", "kimi_linear"])
@pytest.mark.parametrize("share", ["1-per-layer", "25%"])
def test_paged_rows_equal_resident_fused_steps(ckpts, family, share):
    c = ckpts[family]
    resident = _steps(c.model, rows=False)
    try:
        pager = _paged(c, share)
        plan = batch.rows_plan(c.model)
        assert plan is not None and isinstance(plan.decoder, (GqaMoeDecoder, HybridDecoder))
        assert _all_called_back(plan.decoder)
        rows = _steps(c.model, rows=True)
        fused = _steps(c.model, rows=False)
        pager.close()
    finally:
        c.restore()
    assert torch.equal(rows, resident), f"max |diff| {(rows - resident).abs().max().item():.3e}"
    assert torch.equal(fused, resident), f"max |diff| {(fused - resident).abs().max().item():.3e}"
