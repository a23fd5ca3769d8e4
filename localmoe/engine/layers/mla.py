"""DeepSeek-style multi-head latent attention (MLA), NoPE as in Kimi-Linear and Kimi K3.

Per token the cache holds only c = RMSNorm(latent) [kv_lora_rank] and the shared key part
k_r [qk_rope_head_dim] (kv_a_proj_with_mqa's two outputs). Per head h, kv_b_proj's rows
give W_uk[h] [nope, r] and W_uv[h] [v, r]: k_h = [W_uk[h] c, k_r], v_h = W_uv[h] c.
- expanded (prefill): build k_h, v_h for the cached tokens (one key block at a time), then attention.
- absorbed (decode): q_h . k_h = (W_uk[h]^T q_nope_h) . c + q_rope_h . k_r, and
  sum_s p_s v_h(s) = W_uv[h] (sum_s p_s c_s): attend over the cached rows directly, then
  apply W_uv. Which is cheaper depends on T against the cached length; `absorb` decides.
  On the CPU an unpadded absorbed call (every prompt chunk up to ~85 tokens for Kimi's shapes) runs in one C++
  call (kernels/mla_decode `mla_chunk`: each query with the fused decode step's arithmetic, so its bits do not
  depend on the chunk), between the projections.
Kimi applies no rotary to the "rope" part (`use_nope`); DeepSeek rotates q_rope and k_rope
with RoPE over adjacent pairs (interleaved), done here as a de-interleave followed by the
half-split rotation (the dot products are the same), and stores k_rope rotated. K3 gates the
output: o_proj(attn * sigmoid(g_proj(x))). Softmax scale (qk_nope + qk_rope)^-0.5, times
mscale^2 under DeepSeek's YaRN (mscale = 0.1 * mscale_all_dim * ln(factor) + 1).
With `sparse_topk` (engine/sparse_topk.py) each query head keeps only its top-k scores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from localmoe.engine.blockwise import MIN_BLOCK, blockwise_attention, visible_keys
from localmoe.engine.layers import on_device
from localmoe.engine.layers.attention import flash_attention, flash_available, flash_or_none
from localmoe.engine.linear import Linear, make_linear
from localmoe.engine.rope import apply_rope
from localmoe.engine.sparse_topk import keep_topk_scores, topk_indices
from localmoe.engine.state_cache import LatentCache
from localmoe.engine.step import Step
from localmoe.errors import LocalMoEError
from localmoe.kernels.mla_decode import chunk_available, mla_chunk, mla_decode

SCORES_MAX_BYTES = 32 << 20  # fp32 scores of one key block (engine/blockwise.py): longer contexts take more blocks
KV_BLOCK_BYTES = 2 << 20  # fp32 per-head keys and values of one key block in the flash path (no scores kept)


@dataclass(frozen=True, slots=True)
class Config:
    """MLA dimensions and flags (ModelSpec.mla; ModelSpec.dsa.mla for DSA layers)."""

    num_heads: int  # H
    q_lora_rank: int | None  # None: one q_proj; else q_a_proj -> q_a_layernorm -> q_b_proj
    kv_lora_rank: int  # r
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = False  # K3: o_proj(attn * sigmoid(g_proj(x)))
    use_nope: bool = True  # Kimi: no rotary on the "rope" part
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm epsilon (DeepSeek's and Kimi's RMSNorm default)
    scale_factor: float = 1.0  # multiplies the softmax scale (DeepSeek YaRN: mscale^2)
    hidden_size: int = 0  # D, the model's

    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> Config:
        """From a DeepSeek/Kimi-style (text) config.json dict."""
        use_nope = bool(config.get("mla_use_nope", False))
        return cls(num_heads=config["num_attention_heads"], q_lora_rank=config.get("q_lora_rank") or None,
                   kv_lora_rank=config["kv_lora_rank"], qk_nope_head_dim=config["qk_nope_head_dim"],
                   qk_rope_head_dim=config["qk_rope_head_dim"], v_head_dim=config["v_head_dim"],
                   output_gate=bool(config.get("mla_use_output_gate", False)), use_nope=use_nope,
                   scale_factor=1.0 if use_nope else yarn_scale_factor(config.get("rope_scaling")),
                   hidden_size=config["hidden_size"])

    @property
    def row_dim(self) -> int:
        """Values cached per token: kv_lora_rank + qk_rope_head_dim."""
        return self.kv_lora_rank + self.qk_rope_head_dim


def yarn_scale_factor(rope_scaling: dict | None) -> float:
    """DeepSeek's softmax-scale multiplier under YaRN: mscale^2, mscale = 0.1 * mscale_all_dim * ln(factor) + 1."""
    scaling = rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    factor, all_dim = float(scaling.get("factor", 1.0)), scaling.get("mscale_all_dim")
    if kind in (None, "default") or not all_dim or factor <= 1:
        return 1.0
    return (0.1 * float(all_dim) * math.log(factor) + 1.0) ** 2


def rotate_interleaved(x: torch.Tensor, step: Step) -> torch.Tensor:
    """RoPE over adjacent pairs of x [B, T, H, rope] at the step's positions; the result is in
    de-interleaved order (evens then odds), the same for queries and keys."""
    return apply_rope(torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1), step.cos, step.sin)


class MLAttention:
    """MLA over a `LatentCache`; kv_b_proj kept once, in fp32, as W_uk / W_uv per head."""

    def __init__(self, config: Config, q_a_proj: Linear | None, q_a_norm: torch.Tensor | None, q_proj: Linear,
                 kv_a_proj: Linear, kv_a_norm: torch.Tensor, kv_b: torch.Tensor, o_proj: Linear,
                 g_proj: Linear | None = None):
        self.config = config
        H, nope, v = config.num_heads, config.qk_nope_head_dim, config.v_head_dim
        self.q_a_proj, self.q_a_norm, self.q_proj = q_a_proj, q_a_norm, q_proj  # q_proj is q_b_proj under LoRA
        self.kv_a_proj, self.kv_a_norm, self.o_proj, self.g_proj = kv_a_proj, kv_a_norm.float(), o_proj, g_proj
        w_uk, w_uv = kv_b.float().view(H, nope + v, config.kv_lora_rank).split((nope, v), dim=1)
        self.w_uk, self.w_uv = w_uk.contiguous(), w_uv.contiguous()  # [H, nope, r], [H, v, r]
        self.scale = (nope + config.qk_rope_head_dim) ** -0.5 * config.scale_factor
        self.absorb: bool | None = None  # None: by cost; True / False force a path (tests, benchmarks)
        self.sparse_topk: int | None = None  # EngineConfig.sparse_topk, set by the Transformer
        # probe-recall: keep the keys each head of the call's LAST query kept, [B, H, k]
        self.record_selection, self.last_selection = False, None

    @property
    def device(self) -> torch.device:
        """Where the layer's weights live, and so its cache."""
        return self.w_uk.device

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> LatentCache:
        """A paged latent cache on the layer's device; `dtype` is EngineConfig.kv_cache_dtype (float32 | bfloat16 | fp8)."""
        return LatentCache(batch, max_len, self.config.row_dim, dtype, self.device)

    def nbytes(self) -> int:
        linears = [self.q_a_proj, self.q_proj, self.kv_a_proj, self.o_proj, self.g_proj]
        tensors = [self.q_a_norm, self.kv_a_norm, self.w_uk, self.w_uv]
        return sum(m.nbytes() for m in linears if m is not None) + sum(t.nbytes for t in tensors if t is not None)

    def use_absorbed(self, T: int, S: int = 0) -> bool:
        """Absorbed attention costs ~T*S*H*(2r + rope) per call, expanded ~S*H*r*(nope + v) +
        T*S*H*(nope + rope + v): absorb while T*(2r - nope - v) < r*(nope + v). Either runs one key
        block at a time (engine/blockwise.py), so neither needs memory that grows with S."""
        if self.absorb is not None:
            return self.absorb
        c = self.config
        r, nope, v = c.kv_lora_rank, c.qk_nope_head_dim, c.v_head_dim
        return T * (2 * r - nope - v) < r * (nope + v)

    def queries(self, x: torch.Tensor, step: Step | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, hidden] -> q_nope [B, H, T, nope], q_rope [B, H, T, rope] (rotated at `step` without NoPE)."""
        return self.queries_and_resid(x, step)[:2]

    def queries_and_resid(self, x: torch.Tensor, step: Step | None = None):
        """(q_nope, q_rope, q_resid): q_resid [B, T, q_lora_rank] is RMSNorm(q_a_proj(x)) (x without q LoRA),
        the input DSA's indexer shares."""
        B, T, _ = x.shape
        c = self.config
        x = self._q_input(x)
        q_nope, q_rope = self.q_proj(x).view(B, T, c.num_heads, -1).split((c.qk_nope_head_dim, c.qk_rope_head_dim),
                                                                          dim=-1)
        if not c.use_nope:
            if step is None:
                raise LocalMoEError("MLA with RoPE needs the step's positions to rotate its queries")
            q_rope = rotate_interleaved(q_rope, step)
        return q_nope.transpose(1, 2), q_rope.transpose(1, 2), x

    def _q_input(self, x: torch.Tensor) -> torch.Tensor:
        """q_proj's input: RMSNorm(q_a_proj(x)) under q LoRA, else x."""
        if self.q_a_proj is None:
            return x
        return F.rms_norm(self.q_a_proj(x), (self.config.q_lora_rank,), self.q_a_norm, self.config.norm_eps)

    def latent_rows(self, x: torch.Tensor, step: Step | None = None) -> torch.Tensor:
        """x [B, T, hidden] -> cache rows [B, T, r + rope]: RMSNorm(latent) then the rope key part
        (rotated at `step`'s positions unless NoPE)."""
        c = self.config
        latent, k_rope = self.kv_a_proj(x).split((c.kv_lora_rank, c.qk_rope_head_dim), dim=-1)
        if not c.use_nope:
            k_rope = rotate_interleaved(k_rope.unsqueeze(2), step).squeeze(2)
        return torch.cat([F.rms_norm(latent, (c.kv_lora_rank,), self.kv_a_norm, c.norm_eps), k_rope], dim=-1)

    def attend_expanded(self, q_nope, q_rope, rows, mask) -> torch.Tensor:
        """q_* [B, H, T, *], rows [B, S, r + rope], mask [B|1, T, S] | None (None: causal, query t at
        position S - T + t) -> [B, H, T, v]. Per-head keys and values are built one key block at a time;
        an unpadded call on the CPU runs torch's flash kernel on each block (`_flash_expanded`)."""
        r, H = self.config.kv_lora_rank, q_nope.shape[1]

        def block(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
            latent, k_rope = rows[:, lo:hi, :r], rows[:, lo:hi, r:]
            k_nope = torch.einsum("bsr,hnr->bhsn", latent, self.w_uk)
            keys = torch.cat([k_nope, k_rope[:, None].expand(-1, H, -1, -1)], dim=-1)
            return keys, torch.einsum("bsr,hvr->bhsv", latent, self.w_uv)

        q = torch.cat([q_nope, q_rope], dim=-1)
        if mask is None and flash_available(q, rows, rows):
            out = flash_or_none(lambda: self._flash_expanded(q, block, rows.shape[1]))
            if out is not None:
                return out
        return blockwise_attention(q, block, rows.shape[1], mask, self.scale, max_bytes=SCORES_MAX_BYTES)

    def _flash_expanded(self, q: torch.Tensor, block, S: int) -> torch.Tensor:
        """`attend_expanded` for an unpadded causal call without any score matrix: torch's CPU flash kernel
        per block of at most KV_BLOCK_BYTES of keys and values, the blocks merged by their log-sum-exps.
        Keys before the call's first query are seen by every query; in a block of the call's own keys
        [lo, hi) the queries at lo..hi-1 are its causal square (the kernel's `is_causal`) and the later
        ones see it whole, so no mask is built. Values are zero-padded to the key width (one head size)."""
        B, H, T, d = q.shape
        v = self.config.v_head_dim
        start, n = S - T, max(MIN_BLOCK, KV_BLOCK_BYTES // (8 * B * H * d))
        out = q.new_zeros(B, H, T, d)
        lse = q.new_full((B, H, T), float("-inf"))

        def merge(rows: slice, part: tuple[torch.Tensor, torch.Tensor]) -> None:
            o, lp = part
            total = torch.logaddexp(lse[:, :, rows], lp)
            out[:, :, rows].mul_((lse[:, :, rows] - total).exp_()[..., None]).add_(o.mul_((lp - total).exp_()[..., None]))
            lse[:, :, rows] = total

        spans = [(lo, min(lo + n, start)) for lo in range(0, start, n)] + [(lo, min(lo + n, S)) for lo in range(start, S, n)]
        for lo, hi in spans:
            keys, values = block(lo, hi)
            values = F.pad(values, (0, d - v))
            if hi <= start:  # before the first query: seen whole by every query
                merge(slice(0, T), flash_attention(q, keys, values, None, self.scale))
                continue
            a, b = lo - start, hi - start  # the queries at the block's own positions
            merge(slice(a, b), flash_attention(q[:, :, a:b], keys, values, None, self.scale, causal=True))
            if b < T:
                merge(slice(b, T), flash_attention(q[:, :, b:], keys, values, None, self.scale))
        return out[..., :v]

    def absorbed_queries(self, q_nope: torch.Tensor, q_rope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, T, nope], q_rope [B, H, T, rope] -> [B, H, T, r + rope], to dot with cached rows."""
        return torch.cat([torch.einsum("bhtn,hnr->bhtr", q_nope, self.w_uk), q_rope], dim=-1)

    def attend_absorbed(self, q_nope, q_rope, rows, mask, top_k: int | None = None) -> torch.Tensor:
        """Same contract as `attend_expanded`, attending over the cached rows directly; `top_k`: keep
        only each query head's top_k scores (explicit scores over every key)."""
        B, H, T, _ = q_nope.shape
        S, r = rows.shape[1], self.config.kv_lora_rank
        q = self.absorbed_queries(q_nope, q_rope)
        if T == 1 and top_k is None and mask is None:  # unpadded decode: the mla_decode kernel
            lengths = torch.full((B,), S, dtype=torch.int32, device=rows.device)
            out = mla_decode(q.view(B, H, -1), rows, lengths, r, self.scale)  # [B, H, r]
            return torch.einsum("bhr,hvr->bhv", out, self.w_uv)[:, :, None]
        # All heads share one key/value row per token: fold H into the query axis (row h*T + t).
        q = q.reshape(B, 1, H * T, -1)
        if top_k is None:
            out = blockwise_attention(q, lambda lo, hi: (rows[:, None, lo:hi], rows[:, None, lo:hi, :r]), S, mask,
                                      self.scale, (H, T), SCORES_MAX_BYTES)
        else:
            scores = (q @ rows[:, None].transpose(-1, -2)).mul_(self.scale).view(B, H, T, S)
            visible = visible_keys(mask, T, S, 0, S, q.device)
            if visible is not None:
                scores.masked_fill_(~visible, float("-inf"))
            if self.record_selection:
                self.last_selection = topk_indices(scores[:, :, -1], top_k)
            scores = keep_topk_scores(scores, top_k)
            out = scores.softmax(-1).view(B, 1, H * T, S) @ rows[:, None, :, :r]
        return torch.einsum("bhtr,hvr->bhtv", out.view(B, H, T, r), self.w_uv)

    def attend(self, q_nope, q_rope, rows, mask) -> torch.Tensor:
        """The cheaper of the two paths; absorbed with top-k selection when `sparse_topk` < the rows cached."""
        T, S = q_nope.shape[2], rows.shape[1]
        if self.sparse_topk is not None and self.sparse_topk < S:
            return self.attend_absorbed(q_nope, q_rope, rows, mask, self.sparse_topk)
        attend = self.attend_absorbed if self.use_absorbed(T, S) else self.attend_expanded
        return attend(q_nope, q_rope, rows, mask)

    def output(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """attn [B, H, T, v] -> o_proj (after K3's sigmoid gate) [B, T, hidden]."""
        B, _, T, _ = attn.shape
        return self._project(x, attn.transpose(1, 2).reshape(B, T, -1))

    def _project(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [B, T, H v] -> o_proj (after K3's sigmoid gate) [B, T, hidden]."""
        if self.g_proj is not None:
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _chunk_kernel_takes(self, x: torch.Tensor, step: Step) -> bool:
        """Whether this call's attention runs in one C++ call (kernels/mla_decode `mla_chunk`): a CPU call without
        padding (mask None: causal), NoPE (Kimi, K3), no top-k, the path left to cost and absorption the cheaper."""
        T, S = x.shape[1], step.start + x.shape[1]
        return (step.mask is None and self.config.use_nope and self.absorb is None
                and (self.sparse_topk is None or self.sparse_topk >= S) and self.use_absorbed(T, S)
                and chunk_available(x))

    def __call__(self, x: torch.Tensor, step: Step, cache: LatentCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends this step's latent rows to `cache`."""
        if self._chunk_kernel_takes(x, step):
            B, T, _ = x.shape
            q = self.q_proj(self._q_input(x)).view(B, T, self.config.num_heads, -1)
            rows = cache.update(step.start, self.latent_rows(x, step))  # [B, S, r + rope]
            if rows.stride(-1) != 1 or rows.stride(1) != rows.shape[2]:
                rows = rows.contiguous()
            return self._project(x, mla_chunk(q, rows, self.w_uk, self.w_uv, self.scale))
        q_nope, q_rope = self.queries(x, step)
        rows = cache.update(step.start, self.latent_rows(x, step))  # [B, S, r + rope]
        return self.output(x, self.attend(q_nope, q_rope, rows, step.mask))


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `self_attn.*` shapes: q directly or through q LoRA, optional output gate."""
    a, D, H, r = prefix + "self_attn.", cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    n, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    shapes = {a + "kv_a_proj_with_mqa.weight": (r + rope, D), a + "kv_a_layernorm.weight": (r,),
              a + "kv_b_proj.weight": (H * (n + v), r), a + "o_proj.weight": (D, H * v)}
    if cfg.q_lora_rank:
        q = cfg.q_lora_rank
        shapes |= {a + "q_a_proj.weight": (q, D), a + "q_a_layernorm.weight": (q,),
                   a + "q_b_proj.weight": (H * (n + rope), q)}
    else:
        shapes[a + "q_proj.weight"] = (H * (n + rope), D)
    if cfg.output_gate:
        shapes[a + "g_proj.weight"] = (H * v, D)
    return shapes


def parts(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> tuple:
    """MLAttention's constructor arguments after `cfg` from canonical `{prefix}self_attn.*` (DeepSeek names,
    kv_b_proj not absorbed; shapes checked on load)."""
    p = prefix + "self_attn."

    def lin(name: str) -> Linear:
        return make_linear([on_device(weights[p + name + ".weight"], device)], None, dtype)

    q_a, q_norm = None, None
    if cfg.q_lora_rank:
        q_a, q_norm = lin("q_a_proj"), on_device(weights[p + "q_a_layernorm.weight"], device).float()
    return (q_a, q_norm, lin("q_b_proj" if cfg.q_lora_rank else "q_proj"), lin("kv_a_proj_with_mqa"),
            on_device(weights[p + "kv_a_layernorm.weight"], device), on_device(weights[p + "kv_b_proj.weight"], device),
            lin("o_proj"), lin("g_proj") if cfg.output_gate else None)


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> MLAttention:
    """An MLA layer from layer `prefix`'s weights, on `device`."""
    return MLAttention(cfg, *parts(cfg, weights, prefix, device, dtype))
