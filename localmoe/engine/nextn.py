"""A next-n prediction (MTP) layer: DeepSeek-V3's multi-token prediction module, also GLM-4.5's.

Checkpoints append it after the last layer (`model.layers.{num_hidden_layers + k}`, k <
`num_nextn_predict_layers`). For position i it combines the target's hidden state h_i (after the final
norm: what the lm_head reads) with the embedding of the token at i + 1 and predicts the token at i + 2:

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])          (embedding first, then the hidden state)
    y_i = decoder_layer(x_i)                                     (a whole layer of the model, its MoE included,
                                                                  attending over its own cache of x)
    logits_i = head(shared_head.norm(y_i))                       (the model's lm_head where the layer has none)

The embedding (and mostly the head) are the target's: shared, not copied. y_i is the hidden state the
next depth takes instead of h (drafting k tokens chains the layer on its own output, as vLLM and SGLang
do). The decoder layer is built from the model's own layer kinds (the last layer's mixer, a MoE block).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from localmoe.config import ModelSpec
from localmoe.engine.cache import ModelCache
from localmoe.engine.layers import moe, on_device
from localmoe.engine.linear import make_linear
from localmoe.engine.quantized import BlockEmbedding
from localmoe.engine.step import make_step
from localmoe.engine.transformer import MIXERS, MLPS, layer_config

OWN = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight")  # besides the decoder layer
OWN_HEAD = "shared_head.head.weight"  # optional: DeepSeek-V3 ships a copy of the lm_head, GLM-4.5 does not


def kinds(spec: ModelSpec) -> tuple[str, str]:
    """The MTP layer's (mixer, MLP) kinds: the last layer's mixer, a MoE block."""
    return spec.layer_kinds[-1], "moe" if spec.num_experts else spec.mlp_kinds[-1]


def tensors(spec: ModelSpec, index: int = 0) -> dict[str, tuple[int, ...]]:
    """Canonical names and shapes of MTP layer `index` (at `layers.{num_layers + index}.`), its own head excluded."""
    D, p = spec.hidden_size, f"layers.{spec.num_layers + index}."
    mixer, ffn = kinds(spec)
    shapes = {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
              p + "eh_proj.weight": (D, 2 * D), **{p + n: (D,) for n in OWN[1:]}}
    shapes |= MIXERS[mixer].tensors(layer_config(spec, mixer), p)
    cfg = layer_config(spec, ffn)
    return shapes | (moe.tensors(cfg, p) if ffn == "moe" else MLPS[ffn].tensors(cfg, p))


class NextN:
    """MTP layer `index` of `target` (a Transformer), from its canonical `weights` (`tensors` names, plus
    `shared_head.head.weight` where the checkpoint has one); its routed experts from `experts` (an
    ExpertProvider: a packed store's, layer num_layers + index) where given, else from `weights`."""

    def __init__(self, target, weights: dict, index: int = 0, experts=None):
        spec, config = target.spec, target.config
        device, dtype = target.device, config.dtype
        p = f"layers.{spec.num_layers + index}."
        self.spec, self.device, self.eps, self.rope = spec, device, spec.rms_norm_eps, target.rope
        self.embed = target.embed

        def norm(name: str) -> torch.Tensor:
            return on_device(weights[p + name], device).float()

        self.enorm, self.hnorm, self.head_norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
        self.eh_proj = make_linear([on_device(weights[p + "eh_proj.weight"], device)], None, dtype)
        mixer, ffn = kinds(spec)
        self.input_norm, self.post_norm = norm("input_layernorm.weight"), norm("post_attention_layernorm.weight")
        self.mixer = MIXERS[mixer].build(layer_config(spec, mixer), weights, p, device, dtype)
        self.mlp = MLPS[ffn].build(layer_config(spec, ffn), weights, p, device, dtype)
        if isinstance(self.mlp, moe.MoEBlock):
            self.mlp.precision = config.expert_kernel_precision
            if experts is not None:  # the routed experts from a provider (a packed store's pager), not `weights`
                self.mlp.experts = experts
        own = weights.get(p + OWN_HEAD)
        self.own_head = own is not None
        self.head = make_linear([on_device(own, device)], None, dtype) if self.own_head else target.lm_head

    def new_cache(self, max_len: int, dtype: str = "float32") -> ModelCache:
        return ModelCache([self.mixer.new_cache(1, max_len, dtype)], 1, max_len, self.device)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) if isinstance(self.embed, BlockEmbedding) else F.embedding(tokens, self.embed)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden: torch.Tensor, cache: ModelCache) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [T] (t_{i+1}) and the hidden states [T, D] (h_i) of T consecutive positions i, appended to
        `cache` -> (logits [T, V], the layer's output y [T, D]: the next depth's hidden states)."""
        D, T = self.spec.hidden_size, tokens.shape[0]
        e = F.rms_norm(self._embed(tokens.to(self.device)).float(), (D,), self.enorm, self.eps)
        h = F.rms_norm(hidden.to(self.device).float(), (D,), self.hnorm, self.eps)
        x = self.eh_proj(torch.cat([e, h], dim=-1).unsqueeze(0))  # [1, T, D]
        start = cache.reserve(T)
        step = make_step(cache, start, T, self.rope)
        x = x + self.mixer(F.rms_norm(x, (D,), self.input_norm, self.eps), step, cache.layers[0])
        x = x + self.mlp(F.rms_norm(x, (D,), self.post_norm, self.eps))
        cache.advance(T)
        return self.head(F.rms_norm(x, (D,), self.head_norm, self.eps))[0], x[0]

    def nbytes(self) -> int:
        """Bytes of weights this layer holds beyond the target's (its own head, if any, included)."""
        own = self.head.nbytes() if self.own_head else 0
        return self.mixer.nbytes() + self.mlp.nbytes() + self.eh_proj.nbytes() + own
