"""Qwen3-Next (`qwen3_next`): Gated DeltaNet layers + gated full attention every
`full_attention_interval` layers; softmax-routed MoE with one sigmoid-gated shared expert.

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`.

Quirks, each covered by tests/models/test_qwen3_next.py:
- the decoder RMSNorms (input / post-attention / final, and attention q_norm / k_norm)
  compute `x * (1 + w)`: their weights get +1 when loaded, so the engine's plain RMSNorm
  applies them; the Gated DeltaNet output norm `linear_attn.norm` is a plain `x * w`.
- full attention: q_proj rows hold [query; gate] per head (`attn_output_gate`), RoPE on
  the first `partial_rotary_factor` (0.25) of each head.
- `mlp.gate` is the router (softmax, top-k renormalised by `norm_topk_prob`);
  `mlp.shared_expert.*` the shared expert, scaled by sigmoid(`mlp.shared_expert_gate`).
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers.gated_deltanet import GatedDeltaConfig
from localmoe.engine.layers.mlp import gated_mlp_shapes
from localmoe.engine.layers.moe import expert_shapes
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import require


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(layers)]
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    heads = require(config, "num_attention_heads")
    rope = config.get("rope_parameters") or {}
    return ModelSpec(
        model_type="qwen3_next", family="qwen3_next",
        vocab_size=require(config, "vocab_size"),
        hidden_size=require(config, "hidden_size"),
        num_layers=layers, num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=require(config, "intermediate_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        attn_output_gate=True, qk_norm=True,
        max_position_embeddings=config.get("max_position_embeddings", 262144),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        layer_kinds=tuple("attention" if t == "full_attention" else "gated_delta" for t in types),
        mlp_kinds=tuple("dense" if i in dense or (i + 1) % step else "moe" for i in range(layers)),
        num_experts=require(config, "num_experts"),
        num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        num_shared_experts=1 if config.get("shared_expert_intermediate_size") else 0,
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        **GatedDeltaConfig.from_hf(config).spec_fields(),
    )


def plus_one(tensor: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """A `(1 + w)` RMSNorm weight as the plain `w` the engine applies."""
    return tensor + 1


_GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
        "out_proj.weight")
_L = "model.layers.{i}."

HF_TENSORS = TensorMap(
    rules=(
        TensorRule("model.embed_tokens.weight", "embed_tokens.weight"),
        TensorRule("model.norm.weight", "norm.weight", plus_one),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(_L + n, "layers.{i}." + n, plus_one)
          for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight")),
        *(TensorRule(_L + f"self_attn.{m}.weight", f"layers.{{i}}.self_attn.{m}.weight")
          for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(TensorRule(_L + f"linear_attn.{n}", f"layers.{{i}}.linear_attn.{n}") for n in _GDN),
        TensorRule(_L + "mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *(TensorRule(_L + f"mlp.experts.{{e}}.{m}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{m}.weight")
          for m in ("gate", "up", "down")),
        *(TensorRule(_L + f"mlp.shared_expert.{m}_proj.weight", f"layers.{{i}}.mlp.shared_experts.{m}_proj.weight")
          for m in ("gate", "up", "down")),
        TensorRule(_L + "mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
        *(TensorRule(_L + f"mlp.{m}_proj.weight", f"layers.{{i}}.mlp.{m}_proj.weight") for m in ("gate", "up", "down")),
    ),
    ignore=(r"rotary_emb\.inv_freq$", r"^mtp\."),  # multi-token-prediction head: not used for decoding
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    D, E, c = spec.hidden_size, spec.num_experts, GatedDeltaConfig.from_spec(spec)
    H, Hkv, hd = spec.num_heads, spec.num_kv_heads, spec.head_dim
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    G = c.num_value_heads // c.num_key_heads
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        shapes |= {p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)}
        if spec.layer_kinds[i] == "gated_delta":
            a, Hk, Hv, K, V = p + "linear_attn.", c.num_key_heads, c.num_value_heads, c.key_head_dim, c.value_head_dim
            shapes |= {a + "in_proj_qkvz.weight": (Hk * (2 * K + 2 * G * V), D), a + "in_proj_ba.weight": (2 * Hv, D),
                       a + "conv1d.weight": (c.conv_channels, 1, c.conv_kernel), a + "A_log": (Hv,),
                       a + "dt_bias": (Hv,), a + "norm.weight": (V,), a + "out_proj.weight": (D, Hv * V)}
        else:
            a = p + "self_attn."
            shapes |= {a + "q_proj.weight": (2 * H * hd, D), a + "k_proj.weight": (Hkv * hd, D),
                       a + "v_proj.weight": (Hkv * hd, D), a + "o_proj.weight": (D, H * hd),
                       a + "q_norm.weight": (hd,), a + "k_norm.weight": (hd,)}
        m = p + "mlp."
        if spec.mlp_kinds[i] == "dense":
            shapes |= gated_mlp_shapes(m, D, spec.intermediate_size)
            continue
        shapes |= {m + "router.weight": (E, D)} | expert_shapes(spec, m, D)
        if spec.num_shared_experts:
            shapes |= gated_mlp_shapes(m + "shared_experts.", D, spec.shared_expert_intermediate_size)
            shapes[m + "shared_expert_gate.weight"] = (1, D)
    return shapes


_EXPERT = "model.layers.{i}.mlp.experts.{e}"

FAMILY = register(ModelFamily(
    name="qwen3_next",
    model_types=("qwen3_next",),
    spec_from_hf=spec_from_hf,
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
   
    experts=ExpertTensors("bf16", {"gate": f"{_EXPERT}.gate_proj.weight", "up": f"{_EXPERT}.up_proj.weight",
                                   "down": f"{_EXPERT}.down_proj.weight"}),
))
