"""Kimi-Linear (`kimi_linear`): KDA delta-rule layers + MLA every few layers, sigmoid-routed MoE.

Checkpoint facts: layer lists in `linear_attn_config` are 1-indexed; routed experts are
per-expert bf16 `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down).

Quirks, each covered by tests/models/test_kimi_linear.py:
- `block_sparse_moe.*` is renamed to the canonical `mlp.*`: `gate.weight` -> `mlp.router.weight`,
  `gate.e_score_correction_bias` -> `mlp.router.e_score_correction_bias`, `w1/w3/w2` -> gate/up/down.
- router: sigmoid scores, correction bias for selection only, renormalised (`moe_renormalize`),
  times `routed_scaling_factor` (2.446); shared experts added unscaled.
- KDA layers use the Kimi-Linear gate (-exp(A_log) * softplus); MLA layers are NoPE without q LoRA.
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.engine.layers.kda import kda_shapes
from localmoe.engine.layers.mla import mla_shapes
from localmoe.engine.layers.moe import moe_shapes
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import kimi_text_spec


def spec_from_hf(config: dict) -> ModelSpec:
    spec = kimi_text_spec(config, "kimi_linear", "kimi_linear")
    act = config.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise UnsupportedModelError(f"kimi_linear: moe_router_activation_func {act!r} is not supported (sigmoid only)")
    return dataclasses.replace(
        spec, scoring_func="sigmoid", expert_act="swiglu",
        norm_topk_prob=bool(config.get("moe_renormalize", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=int(config.get("num_expert_group") or 1) if config.get("use_grouped_topk", True) else 1,
        topk_group=int(config.get("topk_group") or 1) if config.get("use_grouped_topk", True) else 1)


_KDA = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
        "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_a_proj.weight",
        "g_b_proj.weight", "A_log", "dt_bias", "o_norm.weight", "o_proj.weight"]
_MLA = ["kv_a_proj_with_mqa.weight", "kv_a_layernorm.weight", "kv_b_proj.weight"]  # + q_proj, o_proj above
_MOE = [("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "router.e_score_correction_bias"),
        ("experts.{e}.w1.weight", "experts.{e}.gate.weight"), ("experts.{e}.w3.weight", "experts.{e}.up.weight"),
        ("experts.{e}.w2.weight", "experts.{e}.down.weight"),
        *((f"shared_experts.{n}_proj.weight",) * 2 for n in ("gate", "up", "down"))]


HF_TENSORS = TensorMap(
    rules=(
        TensorRule("model.embed_tokens.weight", "embed_tokens.weight"),
        TensorRule("model.norm.weight", "norm.weight"),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(f"model.layers.{{i}}.{n}", f"layers.{{i}}.{n}")
          for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                    *(f"self_attn.{t}" for t in _KDA + _MLA),
                    *(f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")))),
        *(TensorRule(f"model.layers.{{i}}.block_sparse_moe.{src}", f"layers.{{i}}.mlp.{dst}") for src, dst in _MOE),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical tensor shapes of a Kimi-Linear model: KDA or MLA attention per layer, DeepSeek-style MoE."""
    D = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    for i in range(spec.num_layers):
        a = f"layers.{i}.self_attn."
        if spec.layer_kinds[i] == "kda":
            shapes |= kda_shapes(spec, a)
        else:
            if spec.q_lora_rank and spec.family == "kimi_linear":
                raise UnsupportedModelError("kimi_linear: MLA with q_lora_rank is not supported (Kimi-Linear has none)")
            shapes |= mla_shapes(spec, a)
        shapes |= moe_shapes(spec, i)
    return shapes


_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}"

FAMILY = register(ModelFamily(
    name="kimi_linear",
    model_types=("kimi_linear",),
    spec_from_hf=spec_from_hf,
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
   
    experts=ExpertTensors("bf16", {"gate": f"{_EXPERT}.w1.weight", "up": f"{_EXPERT}.w3.weight",
                                   "down": f"{_EXPERT}.w2.weight"}),
))
