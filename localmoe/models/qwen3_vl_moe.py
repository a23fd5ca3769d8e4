"""Qwen3-VL-MoE (`qwen3_vl_moe`, transformers `Qwen3VLMoeForConditionalGeneration`: Qwen3-VL-30B-A3B,
Qwen3-VL-235B-A22B): the Qwen3-VL vision encoder with its deep-stack mergers (engine/layers/vision_qwen3vl.py)
on a Qwen3-MoE text model (`text_config`, read by the qwen3_moe family through the registry: no family
imports another) whose rotary positions are MRoPE (`rope_parameters.mrope_section`, interleaved).
Image placeholder tokens (`image_token_id`, `<|image_pad|>`) take the merger's embeddings, one per 2x2
patch block, and the deep-stack features are added to their hidden states after the first text layers.

Checkpoint layout (the released one): text under `model.language_model.{embed_tokens,layers.{i},norm}`,
`lm_head.weight` at the top, the tower under `model.visual.*`; routed experts stacked per layer as
`mlp.experts.gate_up_proj` [E, D, 2I] (gate columns first, then up) and `mlp.experts.down_proj` [E, I, D].

Quirks, each covered by tests/models/test_qwen3_vl_moe.py:
- transformers' `save_pretrained` writes the stacked experts as it holds them, [E, 2I, D] and [E, D, I]; its
  loader tells the two layouts apart by shape (a tensor already in its own shape is kept), and so do we
  (`_gate_up`, `_down`; the same rule where D == 2I or D == I makes the two shapes equal).
- the top-level `tie_word_embeddings` decides (the text_config's is transformers' default, True, even where
  the checkpoint has its own lm_head).
- the router always renormalises the top-k weights (Qwen3-MoE reads `norm_topk_prob`, which this config lacks).
- `mrope_interleaved` false (Qwen2.5-VL's sectioned layout) is refused: transformers' Qwen3-VL interleaves.
"""

from __future__ import annotations

import dataclasses

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers import moe, vision_qwen3vl
from localmoe.engine.transformer import model_tensors
from localmoe.errors import UnsupportedModelError
from localmoe.models import family_for_model_type, register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import require

TEXT = "model.language_model."
EXPERTS = TEXT + "layers.{i}.mlp.experts."


def spec_from_hf(config: dict) -> ModelSpec:
    """Qwen3-MoE text spec (`text_config`, MRoPE) plus the Qwen3-VL tower (`vision_config`)."""
    text = dict(require(config, "text_config"))
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    section = rope.get("mrope_section")
    if section is None:
        raise UnsupportedModelError("config.json: qwen3_vl_moe text_config.rope_parameters has no mrope_section")
    if not rope.get("mrope_interleaved", True):
        raise UnsupportedModelError("config.json: qwen3_vl_moe with mrope_interleaved false (sectioned MRoPE) is "
                                    "not supported")
    text["model_type"] = "qwen3_moe"
    text["norm_topk_prob"] = True  # the router always renormalises the chosen weights (no such config key)
    text["tie_word_embeddings"] = bool(config.get("tie_word_embeddings", False))
    spec = family_for_model_type("qwen3_moe").spec_from_hf(text)
    vision = vision_qwen3vl.Config.from_hf(require(config, "vision_config"))
    if vision.out_hidden_size != spec.hidden_size:
        raise UnsupportedModelError(f"config.json: vision_config.out_hidden_size {vision.out_hidden_size} is not "
                                    f"the text model's hidden_size {spec.hidden_size}")
    return dataclasses.replace(spec, model_type="qwen3_vl_moe", family="qwen3_vl_moe", vision=vision,
                               image_token_id=config.get("image_token_id", 151655), mrope_section=tuple(section))


def _stacked(t: torch.Tensor, ours: tuple[int, int]) -> torch.Tensor:
    """[E, a, b] -> [E, *ours]: kept when it is in that shape already (transformers' rule), else transposed."""
    return t if tuple(t.shape[1:]) == ours else t.transpose(1, 2).contiguous()


def _gate_up(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return _stacked(t, (2 * spec.moe_intermediate_size, spec.hidden_size))


def _down(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return _stacked(t, (spec.hidden_size, spec.moe_intermediate_size))


def stacked_expert_shapes(cfg: moe.Config, m: str) -> dict[str, tuple[int, ...]]:
    """The routed experts as two stacked tensors, gate rows then up rows ([E, 2I, D]) and down ([E, D, I])."""
    E, Im, W = cfg.num_experts, cfg.moe_intermediate_size, cfg.width
    return {m + "experts.gate_up_proj.weight": (E, 2 * Im, W), m + "experts.down_proj.weight": (E, W, Im)}


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    return model_tensors(spec, stacked_expert_shapes)


def _rules() -> tuple[TensorRule, ...]:
    qwen3 = family_for_model_type("qwen3_moe").hf_tensors
    text = [TensorRule(TEXT + r.source[len("model."):], r.target, r.transform) for r in qwen3.rules
            if r.source.startswith("model.") and ".experts." not in r.source]
    return (*text, TensorRule("lm_head.weight", "lm_head.weight"),
            TensorRule(EXPERTS + "gate_up_proj", "layers.{i}.mlp.experts.gate_up_proj.weight", _gate_up),
            TensorRule(EXPERTS + "down_proj", "layers.{i}.mlp.experts.down_proj.weight", _down),
            *(TensorRule("model." + n, n) for n in vision_qwen3vl.name_patterns()))


HF_TENSORS = TensorMap(rules=_rules(), ignore=(r"rotary_emb\.inv_freq$",))

FAMILY = register(ModelFamily(
    name="qwen3_vl_moe", model_types=("qwen3_vl_moe",), spec_from_hf=spec_from_hf, hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
    experts=ExpertTensors("bf16_fused", {"gate_up": EXPERTS + "gate_up_proj", "down": EXPERTS + "down_proj"},
                          stacked=True)))
