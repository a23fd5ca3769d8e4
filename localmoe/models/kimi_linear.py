"""Kimi-Linear (`kimi_linear`): KDA delta-rule layers + MLA every few layers, sigmoid-routed MoE.

Checkpoint facts: layer lists in `linear_attn_config` are 1-indexed; routed experts are
per-expert bf16 `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down).

Quirks, each covered by tests/models/test_kimi_linear.py:
- `block_sparse_moe.*` is renamed to the canonical `mlp.*`: `gate.weight` -> `mlp.router.weight`,
  `gate.e_score_correction_bias` -> `mlp.router.e_score_correction_bias`, `w1/w3/w2` -> gate/up/down.
- router: sigmoid scores, correction bias for selection only, renormalised (`moe_renormalize`),
  times `routed_scaling_factor` (2.446); shared experts added unscaled.
- KDA layers use the Kimi-Linear gate (-exp(A_log) * softplus); MLA layers are NoPE without q LoRA.

GGUF (`kimi-linear`, llama.cpp's layout; tests/models/test_moe_gguf.py): a layer is MLA where
`attention.head_count_kv[i]` > 0, KDA where it is 0; KDA tensors are `ssm_*` (`ssm_a` holds -exp(A_log),
read back as log(-ssm_a); the convs are [1, H K, 1, W]; `ssm_dt.bias` is dt_bias), the KDA heads are
`attention.head_count` (llama.cpp writes no other count); MLA's kv_b_proj is joined from `attn_k_b` /
`attn_v_b`; routed experts stacked (models/gguf_experts.py).
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.errors import UnsupportedModelError
from localmoe.models import gguf_experts, register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule, hf_rules
from localmoe.models.moe_config import kimi_text_spec


def spec_from_hf(config: dict) -> ModelSpec:
    spec = kimi_text_spec(config, "kimi_linear", "kimi_linear")
    act = config.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise UnsupportedModelError(f"kimi_linear: moe_router_activation_func {act!r} is not supported (sigmoid only)")
    if spec.mla.q_lora_rank:
        raise UnsupportedModelError("kimi_linear: MLA with q_lora_rank is not supported (Kimi-Linear has none)")
    return dataclasses.replace(
        spec, scoring_func="sigmoid", expert_act="swiglu",
        norm_topk_prob=bool(config.get("moe_renormalize", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=int(config.get("num_expert_group") or 1) if config.get("use_grouped_topk", True) else 1,
        topk_group=int(config.get("topk_group") or 1) if config.get("use_grouped_topk", True) else 1)


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `kimi-linear.*` metadata was converted from."""
    config = gguf_experts.kimi_linear_config(gguf_experts.GGUFKeys(metadata, "kimi-linear"), tensor_names)
    return spec_from_hf(config)


def gguf_tensors(architecture: str) -> TensorMap:
    layer = {**{f"{g}.weight": (f"self_attn.{h}.weight", None) for g, h in gguf_experts.MLA_GGUF.items()},
             **{g: (f"self_attn.{h}", fix) for g, (h, fix) in gguf_experts.KDA_GGUF.items()},
             **{g: (h, None) for g, h in gguf_experts.MOE_GGUF.items()}}
    return gguf_experts.gguf_moe_tensors(layer)


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
        *hf_rules(("input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{t}" for t in _KDA + _MLA),
                   *(f"mlp.{m}_proj.weight" for m in ("gate", "up", "down")))),
        *(TensorRule(f"model.layers.{{i}}.block_sparse_moe.{src}", f"layers.{{i}}.mlp.{dst}") for src, dst in _MOE),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)


_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}"

FAMILY = register(ModelFamily(
    name="kimi_linear", model_types=("kimi_linear",), spec_from_hf=spec_from_hf, hf_tensors=HF_TENSORS,
    experts=ExpertTensors("bf16", {p: f"{_EXPERT}.{w}.weight" for p, w in (("gate", "w1"), ("up", "w3"), ("down", "w2"))}),
    gguf_architectures=("kimi-linear",), spec_from_gguf=spec_from_gguf, gguf_tensors=gguf_tensors,
    gguf_finish=gguf_experts.mla_finish, gguf_experts=gguf_experts.gguf_stacked_experts()))
