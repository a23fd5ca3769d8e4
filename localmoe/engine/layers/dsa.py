"""DSA: DeepSeek sparse attention = MLA (engine/layers/mla.py) attending only to the `index_topk`
cached tokens the lightning indexer (engine/layers/indexer.py) picks for each query.

- the cache is a `DSACache` (engine/layers/index_cache.py): MLA latent rows + one index key per token
  (GLM-5-Next's k-pool indexer, engine/layers/kpool_indexer.py: the key and its pool-gate logits).
- while no query can lose a token (`indexer.dense_context`), nothing is dropped: plain (causal) MLA.
- decode (T <= GATHER_MAX_T): the selected latent rows are gathered, [B, T, k, r + rope], and the
  absorbed attention runs over those k rows only, so its cost stops growing with the context.
- prefill: a [B, T, S] mask of the selected tokens joins the causal mask (same result).
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers.index_cache import DSACache
from localmoe.engine.layers.indexer import LightningIndexer
from localmoe.engine.layers.kpool_indexer import KPoolIndexer
from localmoe.engine.layers.mla import MLAConfig, MLAttention
from localmoe.engine.step import Step
from localmoe.errors import LocalMoEError
from localmoe.kernels.mla_decode import mla_decode_sparse

GATHER_MAX_T = 8  # queries per call up to which the selected rows are gathered instead of masked


class DSAttention(MLAttention):
    """MLA + lightning indexer; `index_topk` from the spec (EngineConfig.sparse_topk does not apply)."""

    indexer: LightningIndexer
    last_selection: torch.Tensor | None  # [B, T, k] of the latest call, kept only while `record_selection`

    @classmethod
    def from_weights(cls, spec: ModelSpec, weights: dict[str, torch.Tensor], prefix: str, dtype: str,
                     config: MLAConfig | None = None) -> DSAttention:
        c = config or MLAConfig.from_spec(spec)
        if not c.q_lora_rank:
            raise LocalMoEError(f"{spec.model_type}: a DSA layer needs q LoRA (the indexer reads its output)")
        if not (spec.index_n_heads and spec.index_head_dim and spec.index_topk):
            raise LocalMoEError(f"{spec.model_type}: DSA layers need index_n_heads, index_head_dim and index_topk "
                                "from config.json")
        layer = super().from_weights(spec, weights, prefix, dtype, c)
        args = (weights, prefix + "self_attn.indexer.", spec.hidden_size, c.q_lora_rank, spec.index_n_heads,
                spec.index_head_dim, c.qk_rope_head_dim, spec.index_topk, dtype)
        layer.indexer = (KPoolIndexer.from_weights(*args, pool=spec.index_kpool, tail=spec.index_kpool_tail)
                         if spec.index_kpool else LightningIndexer.from_weights(*args))
        layer.record_selection, layer.last_selection = False, None
        return layer

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> DSACache:
        """Latent rows and index keys, both in the K/V cache `dtype` (fp8: one scale per row / key block)."""
        return DSACache(batch, max_len, self.config.row_dim, self.indexer.cache_dim, dtype)

    def nbytes(self) -> int:
        return super().nbytes() + self.indexer.nbytes()

    def __call__(self, x: torch.Tensor, step: Step, cache: DSACache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends latent rows and index keys to `cache`."""
        T = x.shape[1]
        q_nope, q_rope, q_resid = self.queries_and_resid(x, step)
        rows = cache.latent.update(step.start, self.latent_rows(x, step))  # [B, S, r + rope]
        keys = cache.index.update(step.start, self.indexer.keys(x, step))  # [B, S, cache_dim]
        S = rows.shape[1]
        if S <= self.indexer.dense_context and not self.record_selection:  # nothing would be dropped
            return self.output(x, self.attend(q_nope, q_rope, rows, step.mask))
        q_index, w = self.indexer.queries(x, q_resid, step)
        selected = self.indexer.select(q_index, w, keys, step)  # [B, T, k], -1 pads
        if self.record_selection:
            self.last_selection = selected
        if T <= GATHER_MAX_T:
            return self.output(x, self.attend_gathered(q_nope, q_rope, rows, selected, step))
        chosen = torch.zeros(*selected.shape[:2], S + 1, dtype=torch.bool)  # column S absorbs the -1 pads
        chosen.scatter_(-1, torch.where(selected < 0, S, selected), True)
        mask = chosen[..., :S] if step.mask is None else chosen[..., :S] & step.mask
        return self.output(x, self.attend(q_nope, q_rope, rows, mask))

    def attend_gathered(self, q_nope, q_rope, rows, selected, step: Step) -> torch.Tensor:
        """Absorbed attention over the selected rows only: rows [B, S, r + rope], selected [B, T, k] -> [B, H, T, v]."""
        B, _, T, _ = q_nope.shape
        r = self.config.kv_lora_rank
        if T == 1 and step.mask is None:  # unpadded decode: the sparse mla_decode kernel
            q = self.absorbed_queries(q_nope, q_rope)[:, :, 0]  # [B, H, r + rope]
            out = mla_decode_sparse(q, rows, selected[:, 0], r, self.scale)  # [B, H, r]
            return torch.einsum("bhr,hvr->bhv", out, self.w_uv)[:, :, None]
        valid = selected >= 0  # [B, T, k]
        if step.mask is not None:  # padding keys a query must not see
            valid &= step.mask.expand(B, -1, -1).gather(-1, selected.clamp(min=0))
        picked = rows.gather(1, selected.clamp(min=0).reshape(B, -1, 1).expand(-1, -1, rows.shape[-1]))
        picked = picked.view(B, T, -1, rows.shape[-1])  # [B, T, k, r + rope]
        q = self.absorbed_queries(q_nope, q_rope)  # [B, H, T, r + rope]
        scores = torch.einsum("bhtd,btkd->bhtk", q, picked) * self.scale
        scores = scores.masked_fill(~valid[:, None], float("-inf"))
        out = torch.einsum("bhtk,btkr->bhtr", scores.softmax(-1), picked[..., :r])
        return torch.einsum("bhtr,hvr->bhtv", out, self.w_uv)
