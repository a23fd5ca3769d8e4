"""Kimi K2.5 (`kimi_k25`, transformers `Kimi_K25ForConditionalGeneration`): the MoonViT vision tower and
projector (engine/layers/vision_moonvit.py) on a DeepSeek-V3 text model (`text_config`, MLA without DSA,
read by the DeepSeek family through the registry: no family imports another). Image placeholder tokens
(`image_token_id`, 163605 `<|media_pad|>`) take the projected image features, one per 2x2 patch block.

Checkpoint layout (the released one, which transformers 5.23 also writes): text under
`language_model.model.layers.*` / `language_model.lm_head`, the tower under `vision_tower.patch_embed.*`
and `vision_tower.encoder.{blocks.{i},final_layernorm}.*`, the projector `mm_projector.{pre_norm,proj.0,proj.2}`.

Quirks, each covered by tests/models/test_kimi_k25.py:
- transformers' `save_pretrained` writes the text layers as `language_model.model.blocks.{i}`, the patch
  embedding as `vision_tower.encoder.patch_embed.proj` and the pre-norm as `model.mm_projector.pre_norm`
  (its load renames run backwards): both spellings are read.
- `wqkv`'s q and k rows keep the released interleaved rotary pairs; the tower rotates them as such.
- `tie_word_embeddings` at the top level ties the text model's head to its embedding.
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.engine.layers import vision_moonvit
from localmoe.models import family_for_model_type, register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import experts, require

TEXT = "language_model."
# (name in the released checkpoint, another spelling transformers' save_pretrained writes)
_SPELLINGS = ((TEXT + "model.layers.", TEXT + "model.blocks."),
              ("vision_tower.patch_embed.proj.", "vision_tower.encoder.patch_embed.proj."),
              ("mm_projector.pre_norm.", "model.mm_projector.pre_norm."))


def spec_from_hf(config: dict) -> ModelSpec:
    """DeepSeek-V3 text spec (`text_config`) plus the MoonViT tower (`vision_config`)."""
    text = dict(require(config, "text_config"))
    if text.get("model_type", "deepseek_v3") in ("kimi_k2", "deepseek_v3"):
        text["model_type"] = "deepseek_v3"
    else:
        from localmoe.errors import UnsupportedModelError

        raise UnsupportedModelError(f"config.json: kimi_k25 text_config.model_type {text['model_type']!r} is not "
                                    "supported (deepseek_v3 / kimi_k2)")
    text["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    spec = family_for_model_type("deepseek_v3").spec_from_hf(text)
    vision = vision_moonvit.Config.from_hf(require(config, "vision_config"), spec.hidden_size,
                                           config.get("projection_layer_norm_eps", 1e-5))
    return dataclasses.replace(spec, model_type="kimi_k25", family="kimi_k25", vision=vision,
                               image_token_id=config.get("image_token_id", 163605))


def _rules() -> tuple[TensorRule, ...]:
    deepseek = family_for_model_type("deepseek_v3").hf_tensors
    text = [TensorRule(TEXT + r.source, r.target, r.transform) for r in deepseek.rules]
    text = [r for r in text if r.source != TEXT + "lm_head.weight"] + [TensorRule(TEXT + "lm_head.weight",
                                                                                  "lm_head.weight")]
    vision = [TensorRule(n, n) for n in vision_moonvit.name_patterns()]
    rules = text + vision
    for released, saved in _SPELLINGS:
        rules += [TensorRule(saved + r.source[len(released):], r.target, r.transform)
                  for r in list(rules) if r.source.startswith(released)]
    return tuple(rules)


HF_TENSORS = TensorMap(rules=_rules(), ignore=(r"rotary_emb\.inv_freq$",))

KIMI_K25 = register(ModelFamily(name="kimi_k25", model_types=("kimi_k25",), spec_from_hf=spec_from_hf,
                                hf_tensors=HF_TENSORS, experts=experts(TEXT + "model.")))
