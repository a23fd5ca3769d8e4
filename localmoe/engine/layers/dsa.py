"""DSA: DeepSeek sparse attention = MLA (engine/layers/mla.py) attending only to the `index_topk`
cached tokens the lightning indexer (engine/layers/indexer.py) picks for each query.

- the cache is a `DSACache` (engine/layers/index_cache.py): MLA latent rows + one index key per token
  (GLM-5-Next's k-pool indexer, engine/layers/kpool_indexer.py: the key and its pool-gate logits).
- while no query can lose a token (`indexer.dense_context`), nothing is dropped: plain (causal) MLA.
- decode (T <= GATHER_MAX_T): the selected latent rows are gathered, [B, T, k, r + rope], and the
  absorbed attention runs over those k rows only, so its cost stops growing with the context.
- prefill: the selected tokens are a mask built one key block at a time (`selection_mask`) for the blockwise
  attention, so no [B, T, S] mask is built: working memory does not grow with the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from localmoe.engine.layers import mla, on_device
from localmoe.engine.layers.index_cache import DSACache
from localmoe.engine.layers.indexer import LightningIndexer
from localmoe.engine.layers.kpool_indexer import KPoolIndexer
from localmoe.engine.linear import Linear
from localmoe.engine.step import Step
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.kernels.mla_decode import mla_decode_sparse

GATHER_MAX_T = 8  # queries per call up to which the selected rows are gathered instead of masked


@dataclass(frozen=True, slots=True)
class Config:
    """A DSA layer: its MLA (which needs q LoRA: the indexer reads its output) and its lightning indexer."""

    mla: mla.Config
    index_n_heads: int  # Hi
    index_head_dim: int  # Di
    index_topk: int  # tokens each query keeps
    # GLM-5-Next's k-pool indexer (kpool_indexer.py): index keys scored in pools of index_kpool consecutive
    # tokens (0 = per token, DeepSeek); the query's incomplete pool is appended raw when index_kpool_tail
    index_kpool: int = 0
    index_kpool_tail: bool = True
    index_rope_interleaved: bool = False  # GLM-5: the indexer's RoPE over adjacent pairs (DeepSeek: half-split)

    def __post_init__(self) -> None:
        if not self.mla.q_lora_rank:
            raise LocalMoEError("a DSA layer needs q LoRA (the indexer reads its output)")
        if not (self.index_n_heads and self.index_head_dim and self.index_topk):
            raise LocalMoEError("DSA layers need index_n_heads, index_head_dim and index_topk")

    @classmethod
    def from_hf(cls, config: dict[str, Any], source: str = "config.json", **fields) -> Config:
        """From a DeepSeek-style (text) config.json dict; `fields` override (e.g. GLM-5-Next's k-pool)."""
        try:
            return cls(mla.Config.from_hf(config), index_n_heads=config["index_n_heads"],
                       index_head_dim=config["index_head_dim"], index_topk=config["index_topk"], **fields)
        except KeyError as e:
            raise CheckpointError(f"{source}: field {e.args[0]!r} is missing (needed by the DSA layers)") from None

    @property
    def hidden_size(self) -> int:
        return self.mla.hidden_size

    @property
    def index_cache_dim(self) -> int:
        """Values the index cache keeps per token: the key (and, k-pool, its pool-gate logits)."""
        return self.index_head_dim * (2 if self.index_kpool else 1)


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s MLA shapes and its indexer's `self_attn.indexer.*` (k-pool: gate and ape too)."""
    Hi, Di, D = cfg.index_n_heads, cfg.index_head_dim, cfg.mla.hidden_size
    x = prefix + "self_attn.indexer."
    shapes = mla.tensors(cfg.mla, prefix) | {
        x + "wq_b.weight": (Hi * Di, cfg.mla.q_lora_rank), x + "wk.weight": (Di, D), x + "k_norm.weight": (Di,),
        x + "k_norm.bias": (Di,), x + "weights_proj.weight": (Hi, D)}
    if cfg.index_kpool:
        shapes |= {x + "index_kpool_compress_ape": (cfg.index_kpool, Di), x + "index_kpool_compress_gate": (Di, D)}
    return shapes


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> DSAttention:
    """A DSA layer (MLA + lightning or k-pool indexer) from layer `prefix`'s weights, on `device`."""
    layer = DSAttention(cfg.mla, *mla.parts(cfg.mla, weights, prefix, device, dtype))
    x = prefix + "self_attn.indexer."

    def w(name: str) -> torch.Tensor:
        return on_device(weights[x + name], device)

    parts = (Linear(w("wq_b.weight"), None, dtype), Linear(w("wk.weight"), None, dtype), w("k_norm.weight"),
             w("k_norm.bias"), Linear(w("weights_proj.weight"), None, "float32"), cfg.index_n_heads,
             cfg.index_head_dim, cfg.mla.qk_rope_head_dim, cfg.index_topk, cfg.index_rope_interleaved)
    layer.indexer = LightningIndexer(*parts) if not cfg.index_kpool else KPoolIndexer(
        *parts, gate=Linear(w("index_kpool_compress_gate"), None, dtype), ape=w("index_kpool_compress_ape"),
        pool=cfg.index_kpool, tail=cfg.index_kpool_tail)
    return layer


def selection_mask(selected: torch.Tensor, mask: torch.Tensor | None):
    """selected [B, T, k] key indices (-1 pads), mask [B|1, T, S] | None -> (lo, hi) -> [B, T, hi - lo] bool: the
    keys lo..hi-1 each query selected (and, padded, may see), the block of the [B, T, S] mask it stands for."""
    def block(lo: int, hi: int) -> torch.Tensor:
        n = hi - lo
        inside = (selected >= lo) & (selected < hi)
        chosen = torch.zeros(*selected.shape[:2], n + 1, dtype=torch.bool, device=selected.device)  # column n: others
        chosen.scatter_(-1, torch.where(inside, selected - lo, n), True)
        return chosen[..., :n] if mask is None else chosen[..., :n] & mask[..., lo:hi]
    return block


class DSAttention(mla.MLAttention):
    """MLA + lightning indexer; `index_topk` from the config (EngineConfig.sparse_topk does not apply)."""

    indexer: LightningIndexer
    last_selection: torch.Tensor | None  # [B, T, k] of the latest call, kept only while `record_selection`

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> DSACache:
        """Latent rows and index keys, both in the K/V cache `dtype` (fp8: one scale per row / key block)."""
        pool = self.indexer.pool if isinstance(self.indexer, KPoolIndexer) else 0
        return DSACache(batch, max_len, self.config.row_dim, self.indexer.cache_dim, dtype, self.device, pool)

    def nbytes(self) -> int:
        return super().nbytes() + self.indexer.nbytes()

    def __call__(self, x: torch.Tensor, step: Step, cache: DSACache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends latent rows and index keys to `cache`."""
        q_nope, q_rope, q_resid = self.queries_and_resid(x, step)
        rows = cache.latent.update(step.start, self.latent_rows(x, step))  # [B, S, r + rope]
        keys = cache.index.update(step.start, self.indexer.keys(x, step))  # [B, S, cache_dim]
        S = rows.shape[1]
        step.selection = None
        if S <= self.indexer.dense_context and not self.record_selection:  # nothing would be dropped
            return self.output(x, self.attend(q_nope, q_rope, rows, step.mask))
        q_index, w = self.indexer.queries(x, q_resid, step)
        selected = self.indexer.select(q_index, w, keys, step, cache.pools)  # [B, T, k], -1 pads
        step.selection = selected  # for the dsa_shared layers after this one (engine/layers/dsa_shared.py)
        if self.record_selection:
            self.last_selection = selected
        return self.attend_selected(x, q_nope, q_rope, rows, selected, step)

    def attend_selected(self, x, q_nope, q_rope, rows, selected, step: Step) -> torch.Tensor:
        """The layer's output when each query attends only to its `selected` [B, T, k] rows (-1 pads)."""
        if x.shape[1] <= GATHER_MAX_T:
            return self.output(x, self.attend_gathered(q_nope, q_rope, rows, selected, step))
        return self.output(x, self.attend(q_nope, q_rope, rows, selection_mask(selected, step.mask)))

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
