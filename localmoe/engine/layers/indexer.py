"""DSA's lightning indexer (DeepSeek-V3.2, GLM-5-Next): which past tokens each query attends to.

Per token: index queries q = wq_b(q_resid) [Hi, Di] from the MLA's normalised q LoRA output,
ONE index key k = LayerNorm(wk(x)) [Di] (weight + bias, eps 1e-6) shared by all index heads,
and head weights w = weights_proj(x) [Hi]. RoPE (half-split, not MLA's interleaved pairs; GLM-5:
interleaved pairs, `interleaved`) rotates the first qk_rope_head_dim dims of q and k. Score of cached token s for query t:
    I[t, s] = sum_h w[t, h] * Hi^-0.5 * Di^-0.5 * relu(q[t, h] . k[s])   (s <= t, else -inf)
and the query keeps the `index_topk` best (kernels/topk_select; of equal scores the earlier
token, so the set depends on the scores only; increasing positions, -1 marks slots beyond the
visible tokens). DeepSeek's
kernels also rotate q and k by a Hadamard transform and score in FP8; the transform is
orthogonal, so q . k is unchanged and is left out here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.engine.layers.mla import rotate_interleaved
from localmoe.engine.linear import Linear
from localmoe.engine.rope import apply_rope
from localmoe.engine.step import Step
from localmoe.kernels.topk_select import topk_select


class LightningIndexer:
    """wq_b [Hi*Di, q_lora], wk [Di, hidden], k_norm (LayerNorm weight, bias) [Di], weights_proj [Hi, hidden]."""

    def __init__(self, wq_b: Linear, wk: Linear, k_norm_weight: torch.Tensor, k_norm_bias: torch.Tensor,
                 weights_proj: Linear, heads: int, head_dim: int, rope_dim: int, top_k: int,
                 interleaved: bool = False):
        self.wq_b, self.wk, self.weights_proj = wq_b, wk, weights_proj
        self.k_norm_weight, self.k_norm_bias = k_norm_weight.float(), k_norm_bias.float()
        self.heads, self.head_dim, self.rope_dim, self.top_k = heads, head_dim, rope_dim, top_k
        self.interleaved = interleaved
        self.weight_scale = (heads * head_dim) ** -0.5  # Hi^-0.5 on the head weights, Di^-0.5 softmax scale

    @property
    def cache_dim(self) -> int:
        """Values the index cache keeps per token (one key)."""
        return self.head_dim

    @property
    def dense_context(self) -> int:
        """Up to this many cached tokens nothing is dropped: every query attends to all it sees."""
        return self.top_k

    def nbytes(self) -> int:
        return (self.wq_b.nbytes() + self.wk.nbytes() + self.weights_proj.nbytes() + self.k_norm_weight.nbytes
                + self.k_norm_bias.nbytes)

    def _rotate(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [B, T, H, Di]: half-split (or interleaved-pair) RoPE on the first rope_dim dims (none under NoPE:
        GLM-5-Next). Interleaved pairs come out de-interleaved, the same for queries and keys: q . k is unchanged."""
        r = self.rope_dim
        if r == 0:
            return x
        rotated = rotate_interleaved(x[..., :r], step) if self.interleaved else apply_rope(x[..., :r], step.cos, step.sin)
        return torch.cat([rotated, x[..., r:]], dim=-1)

    def keys(self, x: torch.Tensor, step: Step) -> torch.Tensor:
        """x [B, T, hidden] -> index keys [B, T, Di] (what the index cache stores)."""
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm_weight, self.k_norm_bias, 1e-6)
        return self._rotate(k.unsqueeze(2), step).squeeze(2)

    def queries(self, x: torch.Tensor, q_resid: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """-> q [B, T, Hi, Di] and the scaled head weights w [B, T, Hi]."""
        B, T, _ = x.shape
        q = self._rotate(self.wq_b(q_resid).view(B, T, self.heads, self.head_dim), step)
        return q, self.weights_proj(x) * self.weight_scale

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, step: Step, kept=None) -> torch.Tensor:
        """q [B, T, Hi, Di], w [B, T, Hi], keys [B, S, Di] -> indices [B, T, top_k] (-1 pads); query t of this
        step sits at cache position step.start + t and sees positions <= it (padding is masked later). `kept`:
        the k-pool indexer's store of pooled keys (none here)."""
        B, T = q.shape[:2]
        positions = torch.arange(step.start, step.start + T, device=q.device).expand(B, T)
        return topk_select(q, w, keys, positions, self.top_k)
