"""gpt-oss (`gpt_oss`): GQA with alternating sliding-window / full layers and sinks; MXFP4 MoE.

Checkpoint facts: experts stacked per layer as MXFP4 `mlp.experts.gate_up_proj_blocks`
[E, 2I, D/32, 16] / `_scales` [E, 2I, D/32] / `_bias` [E, 2I] with gate and up rows
interleaved (gate = even rows), and `down_proj_*` likewise.

Quirks, each covered by tests/models/test_gpt_oss.py:
- gate/up rows (and their bias) are de-interleaved on load into [gate rows; up rows], the
  layout every family's `gate_up_proj` uses; MXFP4 stays bytes (canonical packed layout).
- router: top-k on biased logits, softmax over the chosen; experts: clamped SwiGLU with
  biases, (up + 1) * gate * sigmoid(1.702 gate), limit 7.
- attention: q/k/v/o biases, per-head sinks, sliding-window layers, YaRN with truncate=False.
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family, TensorMap, TensorRule, build_transformer
from localmoe.models.moe_config import require


def _rope(config: dict) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); OpenAI's config `rope_scaling`
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 150000.0)))
    return theta, config.get("rope_scaling") or params or None


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
    heads = require(config, "num_attention_heads")
    theta, scaling = _rope(config)
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"gpt_oss: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    return ModelSpec(
        model_type="gpt_oss", family="gpt_oss",
        vocab_size=require(config, "vocab_size"),
        hidden_size=require(config, "hidden_size"),
        num_layers=layers, num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=require(config, "intermediate_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", True)),
        layer_kinds=tuple("sliding_attention" if t == "sliding_attention" else "attention" for t in types),
        mlp_kinds=("moe",) * layers,
        num_experts=require(config, "num_local_experts"),
        num_experts_per_tok=config.get("num_experts_per_tok") or config.get("experts_per_token"),
        moe_intermediate_size=require(config, "intermediate_size"),
        scoring_func="topk_softmax", expert_act="gpt_oss_swiglu",
        sliding_window=int(config.get("sliding_window") or 128),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )


def _deinterleave(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[E, 2I, ...] rows gate0, up0, gate1, ... -> [gate rows; up rows]."""
    return t.unflatten(1, (t.shape[1] // 2, 2)).transpose(1, 2).reshape(t.shape).contiguous()


def _blocks(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """gpt-oss `*_blocks` [E, R, K/32, 16] -> canonical packed [E, R, K/2] (same nibble order)."""
    return t.reshape(*t.shape[:2], -1)


def _gate_up_blocks(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return _deinterleave(_blocks(t, spec), spec)


_LAYER = [("input_layernorm.weight", None), ("post_attention_layernorm.weight", None),
          *((f"self_attn.{n}_proj.{k}", None) for n in "qkvo" for k in ("weight", "bias")),
          ("self_attn.sinks", None), ("mlp.router.weight", None), ("mlp.router.bias", None)]
_EXPERTS = [("gate_up_proj_blocks", "gate_up_proj.packed", _gate_up_blocks),
            ("gate_up_proj_scales", "gate_up_proj.scales", _deinterleave),
            ("gate_up_proj_bias", "gate_up_proj.bias", _deinterleave),
            ("down_proj_blocks", "down_proj.packed", _blocks),
            ("down_proj_scales", "down_proj.scales", None),
            ("down_proj_bias", "down_proj.bias", None)]

HF_TENSORS = TensorMap(
    rules=(
        TensorRule("model.embed_tokens.weight", "embed_tokens.weight"),
        TensorRule("model.norm.weight", "norm.weight"),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(f"model.layers.{{i}}.{part}", f"layers.{{i}}.{part}", fix) for part, fix in _LAYER),
        *(TensorRule(f"model.layers.{{i}}.mlp.experts.{src}", f"layers.{{i}}.mlp.experts.{dst}", fix)
          for src, dst, fix in _EXPERTS),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    D, hd, E, I = spec.hidden_size, spec.head_dim, spec.num_experts, spec.moe_intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes |= {
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            a + "q_proj.weight": (q, D), a + "k_proj.weight": (kv, D), a + "v_proj.weight": (kv, D),
            a + "o_proj.weight": (D, q), a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
            a + "v_proj.bias": (kv,), a + "o_proj.bias": (D,), a + "sinks": (spec.num_heads,),
            m + "router.weight": (E, D), m + "router.bias": (E,),
            m + "experts.gate_up_proj.packed": (E, 2 * I, D // 2), m + "experts.gate_up_proj.scales": (E, 2 * I, D // 32),
            m + "experts.gate_up_proj.bias": (E, 2 * I),
            m + "experts.down_proj.packed": (E, D, I // 2), m + "experts.down_proj.scales": (E, D, I // 32),
            m + "experts.down_proj.bias": (E, D),
        }
    return shapes


FAMILY = register(Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    gguf_architectures=(),
    spec_from_hf=spec_from_hf,
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
    optional_tensors=(r"^lm_head\.weight$",),
    build=build_transformer,
    experts=ExpertTensors("gpt_oss_mxfp4", {"gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
                                            "down": "model.layers.{i}.mlp.experts.down_proj"}, stacked=True),
))
