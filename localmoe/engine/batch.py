"""One decode step for many sequences at once, each with its own cache (continuous batching).

`decode_batch(model, tokens, caches)` runs one new token of each of N sequences through the
model as one batch: the embedding, every norm, every MLP / MoE layer and the lm_head see the N
tokens as one matrix [N, hidden], so a weight (and a routed expert, grouped by expert in
`moe.dispatch`) is read once per step for all of them. Only the token mixer (attention, MLA,
delta rule: the part that reads each sequence's own cache) runs per sequence, on its row, with
its own positions; the caches stay batch-1 `ModelCache`s of different lengths, so a sequence
joins or leaves between two steps without touching the others.

A row's result does not depend on the others: every matrix of N <= GEMV_MAX_ROWS rows runs the
decode kernels, which compute each row independently, and larger batches are cut into such
slices (`_rowwise`); the mixer runs each sequence alone. So a greedy sequence produces the same
tokens batched with 15 others as alone through this step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from localmoe.engine.cache import ModelCache
from localmoe.engine.moe import MoEBlock
from localmoe.engine.step import make_step
from localmoe.kernels._cpu import small_steps
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS
from localmoe.kernels.rms_norm import add_rms_norm


def batchable(model) -> bool:
    """Whether `model` runs batched decode steps: a Transformer with plain residuals (Kimi K3's attention
    residuals and GLM-5-Next's hyper-connections are not batched yet: their sequences step one at a time)."""
    return hasattr(model, "layers") and hasattr(model, "rope") and getattr(model, "residuals", None) is None


def _rowwise(fn, h: torch.Tensor) -> torch.Tensor:
    """fn over h [N, ...] in slices of at most GEMV_MAX_ROWS rows: the decode kernels, which compute each
    row on its own (a row's result does not depend on the others)."""
    if h.shape[0] <= GEMV_MAX_ROWS:
        return fn(h)
    return torch.cat([fn(part) for part in h.split(GEMV_MAX_ROWS)])


@torch.inference_mode()
def decode_batch(model, tokens: Sequence[int], caches: Sequence[ModelCache]) -> torch.Tensor:
    """One token for each of N sequences (token i appended to caches[i], each of batch 1) -> logits [N, V]."""
    N = len(tokens)
    if N == 1 or not batchable(model):  # the model's own decode step (its fused plan where it has one), each
        return torch.cat([model.forward(torch.tensor([[t]]), c)[:, -1] for t, c in zip(tokens, caches)])
    ids = torch.tensor(tokens, dtype=torch.long).view(N, 1)
    starts = [cache.reserve(1) for cache in caches]
    steps = [make_step(cache, start, 1, model.rope) for cache, start in zip(caches, starts)]
    eps = model.eps
    with small_steps():
        x = F.embedding(ids, model.embed) if torch.is_tensor(model.embed) else model.embed(ids)
        h = add_rms_norm(x, None, model.layers[0][0], eps)
        for i, (_, mixer, mlp_norm, mlp) in enumerate(model.layers):
            mixed = torch.cat([mixer(h[n:n + 1], steps[n], caches[n].layers[i]) for n in range(N)])
            h = add_rms_norm(x, mixed, mlp_norm, eps)
            following = model.layers[i + 1][0] if i + 1 < len(model.layers) else model.norm
            out = mlp(h) if isinstance(mlp, MoEBlock) else _rowwise(mlp, h)  # MoE: experts grouped, read once
            h = add_rms_norm(x, out, following, eps)
        logits = _rowwise(model.lm_head, h)
    for cache in caches:
        cache.advance(1)
    return logits[:, -1]
