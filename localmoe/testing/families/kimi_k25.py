"""Kimi K2.5 (`kimi_k25`, transformers `Kimi_K25ForConditionalGeneration`), bf16: the DeepSeek-V3 text
checkpoint under `language_model.` with the MoonViT tower and projector beside it in the released layout
(`vision_tower.patch_embed.*`, `vision_tower.encoder.blocks.{i}.{wqkv,wo,norm0,norm1,mlp.fc0,mlp.fc1}`,
`vision_tower.encoder.final_layernorm`, `mm_projector.{pre_norm,proj.0,proj.2}`). The tokenizer adds
the media tokens; `<|media_pad|>` is the image placeholder (`image_token_id`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from localmoe.engine.layers import vision_moonvit
from localmoe.testing.families.deepseek_v32 import SIZES as TEXT_SIZES
from localmoe.testing.families.deepseek_v32 import TOKENIZER as DEEPSEEK_TOKENIZER
from localmoe.testing.families.deepseek_v32 import build_v3
from localmoe.testing.layers import tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import norm_weight, normal
from localmoe.testing.tokenizer import TokenizerLayout

MEDIA = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")
TOKENIZER = dataclasses.replace(DEEPSEEK_TOKENIZER, tail=DEEPSEEK_TOKENIZER.tail + MEDIA)

_VISION = {"tiny": {"v_hidden": 32, "v_layers": 2, "v_heads": 2, "v_inter": 48, "v_pos": 8},
           "small": {"v_hidden": 256, "v_layers": 4, "v_heads": 4, "v_inter": 512, "v_pos": 16},
           "large": {"v_hidden": 1152, "v_layers": 8, "v_heads": 16, "v_inter": 4304, "v_pos": 64}}
SIZES = {size: {**TEXT_SIZES[size], **_VISION[size]} for size in TEXT_SIZES}


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    text_config, text = build_v3(d, tok)
    tensors = [dataclasses.replace(t, name="language_model." + t.name) for t in text]
    vision = {"patch_size": 14, "pos_emb_height": d["v_pos"], "pos_emb_width": d["v_pos"], "pos_emb_time": 4,
              "num_attention_heads": d["v_heads"], "num_hidden_layers": d["v_layers"], "hidden_size": d["v_hidden"],
              "intermediate_size": d["v_inter"], "hidden_act": "gelu_pytorch_tanh", "merge_kernel_size": [2, 2],
              "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}, "model_type": "kimi_k25_vision"}
    cfg = vision_moonvit.Config.from_hf(vision, text_config["hidden_size"])
    for name, shape in vision_moonvit.tensors(cfg).items():
        is_norm = "norm" in name and name.endswith(".weight")
        tensors.append(tensor(name, shape, norm_weight() if is_norm else normal(0.02)))
    config = {
        "architectures": ["Kimi_K25ForConditionalGeneration"], "model_type": "kimi_k25",
        "text_config": text_config, "vision_config": vision, "projection_hidden_size": d["v_hidden"],
        "projection_layer_norm_eps": 1e-5, "image_token_id": tok.id("<|media_pad|>"),
        "video_token_id": tok.id("<|media_content|>"), "vision_start_token_id": tok.id("<|media_begin|>"),
        "vision_end_token_id": tok.id("<|media_end|>"), "tie_word_embeddings": False, "dtype": "bfloat16",
    }
    return config, tensors


FAMILY = CheckpointGenerator("kimi_k25", build, SIZES, TOKENIZER)
