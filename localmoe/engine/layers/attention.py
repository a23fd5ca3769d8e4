"""Grouped-query attention with RoPE over a paged KV cache (engine/cache.py).

Options (gpt-oss): an output bias, per-head learned `sinks` (one extra logit column in the
softmax whose value row is zero) and a sliding window (a query at position t sees keys
t - window + 1 .. t). An unpadded prefill without top-k runs torch's CPU flash kernel (`_flash`:
no score matrix, no [T, S] mask, the sinks merged by log-sum-exp; 2.0x the explicit path's
prefill speed at 8k tokens on gpt-oss); a left-padded batch without sinks and window the fused
SDPA path with the batch's mask; otherwise an explicit softmax runs.

Qwen3-Next: RoPE on the first `rotary_dim` dims of each head only (partial_rotary_factor),
and an output gate: q_proj rows hold [query; gate] per head, out = o_proj(attn * sigmoid(gate)).
Optional top-k selection (`sparse_topk`, engine/sparse_topk.py): each query attends only to
its top-k scoring keys; with top-k >= the keys visible it is exactly the dense softmax.
Decode steps (one new token per sequence, no key dropped by top-k) run every head, window and
sink in one `gqa_decode` kernel call (kernels/gqa_decode).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from localmoe.engine.cache import KVCache
from localmoe.engine.layers import on_device
from localmoe.engine.linear import Linear, make_linear
from localmoe.engine.rope import apply_rope
from localmoe.engine.sparse_topk import keep_topk_scores, topk_indices
from localmoe.engine.step import Step
from localmoe.errors import UnsupportedModelError
from localmoe.kernels.gqa_decode import gqa_decode, step_kernel_for


@dataclass(frozen=True, slots=True)
class Config:
    """A GQA layer, from the model's common attention fields (`Config.of(spec)`: GGUF and HF parsers of
    every dense and MoE family fill them; sinks come with the checkpoint's `sinks` tensors)."""

    hidden_size: int  # D
    num_heads: int  # H
    num_kv_heads: int  # H_kv
    head_dim: int
    bias: bool = False  # q/k/v biases (Qwen2, gpt-oss)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    output_gate: bool = False  # Qwen3-Next: q_proj rows hold [query; gate] per head
    sinks: bool = False  # gpt-oss: per-head sink logits and an o_proj bias
    window: int = 0  # keys a sliding layer sees, its own position included; 0 = full attention
    partial_rotary_factor: float = 1.0  # RoPE on the first factor * head_dim dims of each head
    norm_eps: float = 1e-6  # q/k norm epsilon (the model's rms_norm_eps)

    @classmethod
    def of(cls, spec, window: int = 0, sinks: bool = False) -> Config:
        """The attention of a ModelSpec (its common fields); `window` for sliding layers."""
        return cls(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.attention_bias,
                   spec.qk_norm, spec.attn_output_gate, sinks, window, spec.partial_rotary_factor, spec.rms_norm_eps)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class GQAttention:
    """q/k/v from one fused projection; H query heads share H_kv key/value heads."""

    def __init__(self, cfg: Config, qkv: Linear, o_proj: Linear,
                 q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                 sinks: torch.Tensor | None = None, gate: Linear | None = None):
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        self.split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        self.qkv, self.o_proj = qkv, o_proj
        self.q_norm, self.k_norm, self.eps = q_norm, k_norm, cfg.norm_eps
        self.window = cfg.window  # 0 = full attention
        self.gate = gate  # Qwen3-Next output gate [H*D, hidden]
        self.rotary_dim = cfg.rotary_dim
        self.sparse_topk: int | None = None  # EngineConfig.sparse_topk, set by the Transformer
        # probe-recall: keep the keys each query head of the call's LAST query kept, [B, H, k]
        self.record_selection, self.last_selection = False, None
        self.scale = self.head_dim ** -0.5
        # sinks [H] for gqa_decode, and as [Hkv, G, 1, 1] to match the folded query axis of _explicit
        self.head_sinks = None if sinks is None else sinks.float().contiguous()
        self.sinks = None if sinks is None else self.head_sinks.view(self.kv_heads, self.group, 1, 1)
        # one sequence's decode step in one kernel call (kernels/gqa_decode step_kernel_for), where the
        # layer is plain: fp32/bf16 projections, no output gate (q/k norms are in the kernel)
        self.fused_step = None
        if gate is None and isinstance(qkv, Linear) and isinstance(o_proj, Linear):
            norms = [None if n is None else n.float().contiguous() for n in (q_norm, k_norm)]
            self.fused_step = step_kernel_for(qkv.weight, qkv.bias, o_proj.weight, o_proj.bias, self.heads,
                                              self.kv_heads, self.head_dim, self.rotary_dim, self.head_sinks,
                                              self.scale, *norms, self.eps)

    @property
    def device(self) -> torch.device:
        """Where the layer's weights live, and so its cache."""
        return self.o_proj.device

    def new_cache(self, batch: int, max_len: int, dtype: str = "float32") -> KVCache:
        """A paged K/V cache on the layer's device; `dtype` is EngineConfig.kv_cache_dtype (float32 | bfloat16 | fp8)."""
        return KVCache(batch, self.kv_heads, max_len, self.head_dim, dtype, self.device)

    def nbytes(self) -> int:
        return self.qkv.nbytes() + self.o_proj.nbytes() + (self.gate.nbytes() if self.gate is not None else 0)

    def __call__(self, x: torch.Tensor, step: Step, cache: KVCache) -> torch.Tensor:
        """x [B, T, hidden] -> [B, T, hidden]; appends this step's keys/values to `cache`."""
        B, T, _ = x.shape
        if B == T == 1 and self.fused_step is not None and step.mask is None and step.cos is not None \
                and not self._selects(step.start + 1) and x.dtype == torch.float32 and x.is_contiguous():
            pools = cache.decode_pools(step.start)
            if pools is not None:
                first = max(0, step.start + 1 - self.window) if self.window else 0
                return self.fused_step(x, step.cos, step.sin, *pools, step.start, first)
        H, Hkv, D, G = self.heads, self.kv_heads, self.head_dim, self.group
        qk, v = self.qkv(x).split((self.split[0] + self.split[1], self.split[2]), dim=-1)
        qk, v = qk.view(B, T, H + Hkv, D), v.view(B, T, Hkv, D)
        if self.q_norm is not None:
            qk = torch.cat([F.rms_norm(qk[:, :, :H], (D,), self.q_norm, self.eps),
                            F.rms_norm(qk[:, :, H:], (D,), self.k_norm, self.eps)], dim=2)
        if self.rotary_dim < D:  # partial RoPE: rotate the first rotary_dim dims, pass the rest
            rot = self.rotary_dim
            qk = torch.cat([apply_rope(qk[..., :rot], step.cos, step.sin), qk[..., rot:]], dim=-1)
        else:
            qk = apply_rope(qk, step.cos, step.sin)
        q, k = qk.split((H, Hkv), dim=2)  # one rotation for q and k together
        keys, values = cache.update(step.start, k, v)  # [B, T, Hkv, D] in, [B, Hkv, S, D] out
        if T == 1 and not self._selects(keys.shape[2]):  # decode: one kernel call for every head
            first = max(0, step.start + 1 - self.window) if self.window else 0
            visible = None if step.mask is None else step.mask[:, 0]
            out = gqa_decode(q[:, 0], keys, values, self.scale, first, visible, self.head_sinks).view(B, 1, H * D)
        else:
            # Fold the G query heads of each KV head into the query axis, so K/V are never
            # repeated: q [B, Hkv, G*T, D] with row g*T + t, and the mask repeated to match.
            q = q.view(B, T, Hkv, G, D).permute(0, 2, 3, 1, 4).reshape(B, Hkv, G * T, D)
            if self.sinks is None and not self.window and not self._selects(keys.shape[2]) \
                    and step.mask is not None:  # a left-padded batch
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=step.mask.repeat(1, G, 1)[:, None])
            else:
                out = None
                if step.valid is None and not self._selects(keys.shape[2]) and flash_available(q, keys, values):
                    out = flash_or_none(lambda: self._flash(q, keys, values, step.start, T))
                if out is None:
                    out = self._explicit(q, keys, values, step, T)
            out = out.view(B, Hkv, G, T, D).permute(0, 3, 1, 2, 4).reshape(B, T, H * D)
        if self.gate is not None:
            out = out * torch.sigmoid(self.gate(x))
        return self.o_proj(out)

    def _selects(self, S: int) -> bool:
        """Whether top-k selection can drop a key: sparse_topk is set and below the S keys cached."""
        return self.sparse_topk is not None and self.sparse_topk < S

    def _flash(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, T: int) -> torch.Tensor:
        """`_explicit` for an unpadded causal call (window and sinks, no top-k) without the score matrix:
        torch's CPU flash attention over the keys before this call's first query (all visible, no mask)
        and over this call's own keys (a causal, windowed band mask, [G*T, T + window]), merged with
        the sinks through their log-sum-exps."""
        S, G = keys.shape[2], self.group
        # the band: keys [lo, S) against queries start .. start + T - 1; with full attention every query
        # sees the keys before it, unmasked
        lo = max(0, start + 1 - self.window) if self.window else start
        parts = []  # (out [B, Hkv, G*T, D], lse [B, Hkv, G*T])
        if not self.window and start > 0:
            parts.append(flash_attention(q, keys[:, :, :start], values[:, :, :start], None, self.scale))
        key_pos = torch.arange(lo, S)[None, :]
        query_pos = torch.arange(start, start + T)[:, None]
        visible = key_pos <= query_pos
        if self.window:
            visible &= key_pos > query_pos - self.window
        band = torch.zeros(T, S - lo).masked_fill_(~visible, float("-inf")).repeat(G, 1)  # rows g*T + t
        parts.append(flash_attention(q, keys[:, :, lo:], values[:, :, lo:], band, self.scale))
        lse = torch.stack([lse for _, lse in parts])  # [P, B, Hkv, G*T]
        if self.sinks is not None:
            sink = self.sinks.expand(self.kv_heads, G, T, 1).reshape(1, 1, self.kv_heads, G * T)
            lse = torch.cat([lse, sink.expand(1, *lse.shape[1:])])
        weight = torch.softmax(lse, dim=0)  # each part's share of the normaliser; the sink adds no value
        out = parts[0][0] * weight[0, ..., None]
        for i in range(1, len(parts)):
            out += parts[i][0] * weight[i, ..., None]
        return out

    def _explicit(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, step: Step, T: int) -> torch.Tensor:
        """q [B, Hkv, G*T, D], keys/values [B, Hkv, S, D] -> [B, Hkv, G*T, D] with window and sinks."""
        S = keys.shape[2]
        mask = step.mask if step.mask is not None else \
            torch.ones(1, T, S, dtype=torch.bool, device=q.device).tril(S - T)
        first = 0
        if self.window:
            first = max(0, step.start + 1 - self.window)  # no query of this step sees a key before it
            keys, values, mask = keys[:, :, first:], values[:, :, first:], mask[..., first:]
            query_pos = torch.arange(step.start, step.start + T, device=q.device)[:, None]
            mask = mask & (torch.arange(first, S, device=q.device)[None, :] > query_pos - self.window)
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.scale  # [B, Hkv, G*T, S']
        scores = scores.masked_fill(~mask.repeat(1, self.group, 1)[:, None], float("-inf"))
        if self._selects(scores.shape[-1]):
            if self.record_selection:
                B, Hkv = q.shape[:2]
                last = scores.view(B, Hkv, self.group, T, -1)[:, :, :, -1].reshape(B, Hkv * self.group, -1)
                self.last_selection = topk_indices(last, self.sparse_topk) + first  # cache positions
            scores = keep_topk_scores(scores, self.sparse_topk)
        if self.sinks is not None:
            B, Hkv = q.shape[:2]
            sink = self.sinks.expand(Hkv, self.group, T, 1).reshape(1, Hkv, self.group * T, 1)
            scores = torch.cat([scores, sink.expand(B, -1, -1, -1)], dim=-1)
            probs = scores.softmax(dim=-1)[..., :-1]  # the sink takes probability mass, adds no value
        else:
            probs = scores.softmax(dim=-1)
        return torch.matmul(probs, values)


# torch's CPU flash attention with its log-sum-exp: a private op (torch >= 2.3), so a torch that lacks
# it or changed it makes the first call fail, warn once, and leave the explicit path to every later one
_flash_cpu = {"op": getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)}


def flash_available(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether `flash_attention` takes these: torch's CPU flash kernel, fp32 CPU tensors."""
    return _flash_cpu["op"] is not None and all(t.device.type == "cpu" and t.dtype == torch.float32
                                                for t in (q, keys, values))


def flash_or_none(run):
    """run() (a `_flash` call), or None after disabling the flash path where torch's op fails."""
    try:
        return run()
    except (RuntimeError, TypeError) as e:
        _flash_cpu["op"] = None
        warnings.warn(f"localmoe: torch's CPU flash attention failed ({e}); prefill attention with sinks or a "
                      "window uses the explicit softmax from now on", stacklevel=3)
        return None


def flash_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor | None,
                    scale: float, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q keys^T * scale + bias) values and the rows' log-sum-exp of the scores, [B, H, L, D] and
    [B, H, L], without the [L, S] score matrix (torch's CPU flash attention: blocks of queries and keys,
    an online softmax); bias [L, S] fp32 (-inf hides a key) or None; `causal`: query i sees keys 0..i
    (L == S, no bias). q, keys and values share one head size."""
    return _flash_cpu["op"](q, keys, values, is_causal=causal, attn_mask=bias, scale=scale)


# A GQA layer's `self_attn.*` tensors as HF Llama / Mistral / Qwen2 / Qwen3 checkpoints name them.
GQA_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_proj.bias", "k_proj.bias", "v_proj.bias",
               "o_proj.weight", "q_norm.weight", "k_norm.weight")


def rope_from_hf(config: dict) -> tuple[float, dict | None]:
    """RoPE theta and scaling of an HF config: transformers 5 writes `rope_parameters`, older
    configs `rope_theta` + `rope_scaling`."""
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
    scaling = config.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    return theta, scaling


def gqa_fields_from_hf(config: dict, model_type: str) -> dict:
    """The ModelSpec fields of Llama-style GQA attention (heads, head dim, RoPE, Qwen2's q/k/v biases,
    Qwen3's q/k norms) from an HF config; a sliding window is refused."""
    if config.get("sliding_window") and config.get("use_sliding_window", True):
        raise UnsupportedModelError(f"{model_type}: sliding-window attention (sliding_window="
                                    f"{config['sliding_window']}) is not supported by the dense Llama path yet")
    heads = config["num_attention_heads"]
    theta, scaling = rope_from_hf(config)
    return {"num_heads": heads, "num_kv_heads": config.get("num_key_value_heads") or heads,
            "head_dim": config.get("head_dim") or config["hidden_size"] // heads,
            "rope_theta": theta, "rope_scaling": scaling,
            "attention_bias": model_type == "qwen2" or bool(config.get("attention_bias", False)),
            "qk_norm": model_type == "qwen3"}


def tensors(cfg: Config, prefix: str) -> dict[str, tuple[int, ...]]:
    """Layer `prefix`'s `self_attn.*` shapes: q/k/v/o, and the biases, q/k norms, output gate and sinks the
    config has."""
    a, h, d = prefix + "self_attn.", cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    shapes = {a + "q_proj.weight": (2 * q if cfg.output_gate else q, h), a + "k_proj.weight": (kv, h),
              a + "v_proj.weight": (kv, h), a + "o_proj.weight": (h, q)}
    if cfg.bias:
        shapes |= {a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,), a + "v_proj.bias": (kv,)}
    if cfg.qk_norm:
        shapes |= {a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)}
    if cfg.sinks:
        shapes |= {a + "o_proj.bias": (h,), a + "sinks": (cfg.num_heads,)}
    return shapes


def build(cfg: Config, weights: dict[str, torch.Tensor], prefix: str, device: str = "cpu",
          dtype: str = "auto") -> GQAttention:
    """A GQA layer from canonical `{prefix}self_attn.{q,k,v,o}_proj.*` (+ the biases, q/k norms and sinks the
    weights hold; shapes checked on load), on `device`."""
    p = prefix + "self_attn."

    def w(name: str) -> torch.Tensor | None:
        t = weights.get(p + name)
        return on_device(t, device)

    bias = torch.cat([w("q_proj.bias"), w("k_proj.bias"), w("v_proj.bias")]) if cfg.bias else None
    q_proj, gate = w("q_proj.weight"), None
    if cfg.output_gate:  # rows per head: [query D | gate D]
        H, D = cfg.num_heads, cfg.head_dim
        q_proj, g_rows = q_proj.view(H, 2, D, -1).unbind(1)
        q_proj, gate = q_proj.reshape(H * D, -1), make_linear([g_rows.reshape(H * D, -1)], None, dtype)
    qkv = make_linear([q_proj, w("k_proj.weight"), w("v_proj.weight")], bias, dtype)
    return GQAttention(cfg, qkv, make_linear([w("o_proj.weight")], w("o_proj.bias"), dtype), w("q_norm.weight"),
                       w("k_norm.weight"), w("sinks"), gate)
