"""The dense decoder-only transformer built from a ModelSpec and canonical weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.config import EngineConfig, ModelSpec
from localmoe.engine.attention import GQAttention
from localmoe.engine.cache import KVCache, ModelCache
from localmoe.engine.linear import Linear
from localmoe.engine.mlp import ACTIVATIONS, GatedMLP
from localmoe.engine.rope import RotaryTable
from localmoe.errors import LocalMoEError


class DenseTransformer:
    """Embedding -> N x (RMSNorm, attention, RMSNorm, MLP) -> RMSNorm -> lm_head. fp32 activations."""

    def __init__(self, spec: ModelSpec, weights: dict[str, torch.Tensor], config: EngineConfig):
        if spec.hidden_act not in ACTIVATIONS:
            raise LocalMoEError(f"hidden_act {spec.hidden_act!r} is not supported ({', '.join(ACTIVATIONS)})")
        self.spec, self.config = spec, config
        self.max_context = config.context_for(spec)
        self.eps = spec.rms_norm_eps
        dtype = config.dtype
        self.embed = weights["embed_tokens.weight"].float()
        head = weights.get("lm_head.weight", self.embed)
        self.lm_head = Linear(head, None, dtype)
        self.norm = weights["norm.weight"].float()
        self.rope = RotaryTable(spec.head_dim, spec.rope_theta, spec.rope_scaling, self.max_context)
        if "rope_freqs.weight" in weights:  # GGUF llama3: per-frequency divisors instead of metadata
            self.rope = RotaryTable(spec.head_dim, spec.rope_theta, None, self.max_context,
                                    freq_factors=weights["rope_freqs.weight"])
        self.layers = []
        for i in range(spec.num_layers):
            p = f"layers.{i}."
            w = lambda name: weights[p + name]  # noqa: E731
            qkv_bias = None
            if spec.attention_bias:
                qkv_bias = torch.cat([w("self_attn.q_proj.bias"), w("self_attn.k_proj.bias"),
                                      w("self_attn.v_proj.bias")])
            qkv = Linear(torch.cat([w("self_attn.q_proj.weight"), w("self_attn.k_proj.weight"),
                                    w("self_attn.v_proj.weight")]), qkv_bias, dtype)
            attention = GQAttention(spec, qkv, Linear(w("self_attn.o_proj.weight"), None, dtype),
                                    weights.get(p + "self_attn.q_norm.weight"),
                                    weights.get(p + "self_attn.k_norm.weight"))
            mlp = GatedMLP(Linear(torch.cat([w("mlp.gate_proj.weight"), w("mlp.up_proj.weight")]), None, dtype),
                           Linear(w("mlp.down_proj.weight"), None, dtype), spec.hidden_act)
            self.layers.append((w("input_layernorm.weight").float(), attention,
                                w("post_attention_layernorm.weight").float(), mlp))

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> ModelCache:
        """A preallocated cache for `batch` sequences of up to `max_len` tokens."""
        max_len = max_len or self.max_context
        spec = self.spec
        layers = [KVCache(batch, spec.num_kv_heads, max_len, spec.head_dim) for _ in range(spec.num_layers)]
        return ModelCache(layers, batch, max_len)

    def _positions_and_mask(self, cache: ModelCache, start: int, T: int):
        """positions [B|1, T] and the attention mask [B|1, 1, G*T, S] (None when nothing is hidden)."""
        S = start + T
        G = self.spec.num_heads // self.spec.num_kv_heads
        if cache.key_mask is None:
            positions = torch.arange(start, S).unsqueeze(0)
            if T == 1:
                return positions, None
            causal = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)
            return positions, causal.repeat(G, 1)[None, None]
        valid = cache.key_mask[:, :S]  # [B, S]
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)[:, start:]
        causal = torch.ones(T, S, dtype=torch.bool).tril(diagonal=start)
        mask = causal[None] & valid[:, None, :]
        # A padding query sees no key; let it see itself so its (ignored) output stays finite.
        mask[:, torch.arange(T), torch.arange(start, S)] = True
        return positions, mask.repeat(1, G, 1)[:, None]

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, cache: ModelCache, mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """tokens [B, T] (left-padded rows marked False in mask [B, T]) -> logits [B, T|1, V] fp32.

        Appends the new keys/values to `cache`; prefill and decode are the same call.
        """
        B, T = tokens.shape
        start = cache.reserve(T)
        cache.append_mask(mask, T)
        positions, attn_mask = self._positions_and_mask(cache, start, T)
        cos, sin = self.rope.at(positions)
        hidden = self.spec.hidden_size
        x = F.embedding(tokens, self.embed)
        for i, (attn_norm, attention, mlp_norm, mlp) in enumerate(self.layers):
            x = x + attention(F.rms_norm(x, (hidden,), attn_norm, self.eps), cos, sin, cache.layers[i], start,
                              attn_mask)
            x += mlp(F.rms_norm(x, (hidden,), mlp_norm, self.eps))
        cache.advance(T)
        if not all_logits:
            x = x[:, -1:]
        return self.lm_head(F.rms_norm(x, (hidden,), self.norm, self.eps))

    def weight_bytes(self) -> int:
        total = self.embed.nbytes + self.lm_head.nbytes() + self.norm.nbytes
        for attn_norm, attention, mlp_norm, mlp in self.layers:
            total += attention.qkv.nbytes() + attention.o_proj.nbytes() + mlp.gate_up.nbytes() + mlp.down.nbytes()
        return total
