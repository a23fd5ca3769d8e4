"""A "shared" DSA layer (GLM-5's `indexer_types` "shared", transformers GlmMoeDsaAttention): MLA with no
indexer of its own, each query attending to the tokens the latest full DSA layer (engine/layers/dsa.py)
selected for it in the same call (`Step.selection`). The layer's Config is the model's `dsa` one; its
cache is MLA's latent rows only (no index keys).
"""

from __future__ import annotations

import torch

from localmoe.engine.layers import mla
from localmoe.engine.layers.dsa import Config, DSAttention
from localmoe.engine.state_cache import LatentCache
from localmoe.engine.step import Step
from localmoe.errors import LocalMoEError

__all__ = ["Config", "SharedDSAttention", "build", "tensors"]


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s MLA shapes (no `self_attn.indexer.*`)."""
    return mla.tensors(cfg.mla, prefix)


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> SharedDSAttention:
    layer = SharedDSAttention(cfg.mla, *mla.parts(cfg.mla, weights, prefix, device, dtype))
    layer.dense_context = cfg.index_topk
    return layer


class SharedDSAttention(DSAttention):
    """MLA attending to the previous DSA layer's selection once the context exceeds index_topk."""

    dense_context: int  # up to this many cached tokens every query attends to all it sees (as the indexer)

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> LatentCache:
        return mla.MLAttention.new_cache(self, batch, max_len, dtype)

    def nbytes(self) -> int:
        return mla.MLAttention.nbytes(self)

    def __call__(self, x: torch.Tensor, step: Step, cache: LatentCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends this step's latent rows to `cache`."""
        q_nope, q_rope = self.queries(x, step)
        rows = cache.update(step.start, self.latent_rows(x, step))  # [B, S, r + rope]
        selected = step.selection
        if rows.shape[1] <= self.dense_context and not (self.record_selection and selected is not None):
            return self.output(x, self.attend(q_nope, q_rope, rows, step.mask))
        if selected is None:
            raise LocalMoEError("a shared DSA layer runs with no full DSA layer's selection before it in the call")
        if self.record_selection:  # probe-recall: the selection this layer attended to
            self.last_selection = selected
        return self.attend_selected(x, q_nope, q_rope, rows, selected, step)
