"""Qwen3-VL-MoE (`qwen3_vl_moe`, transformers `Qwen3VLMoeForConditionalGeneration`), bf16, as Qwen ships it:
the Qwen3-MoE text model under `model.language_model.` with its routed experts stacked per layer
(`mlp.experts.gate_up_proj` [E, D, 2I], `mlp.experts.down_proj` [E, I, D]), `lm_head` at the top, the
Qwen3-VL tower under `model.visual.` (patch embedding, position table, blocks, merger, deep-stack mergers),
MRoPE positions (`rope_parameters.mrope_section`, interleaved). The tokenizer adds the vision tokens;
`<|image_pad|>` is the image placeholder (`image_token_id`); `preprocessor_config.json` sets the image
processor's pixel budget."""

from __future__ import annotations

import dataclasses
from typing import Any

from localmoe.engine.layers import vision_qwen3vl
from localmoe.testing.families.qwen3_next import TOKENIZER as QWEN_TOKENIZER
from localmoe.testing.layers import linear, norm, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import norm_weight, normal
from localmoe.testing.tokenizer import TokenizerLayout

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
TOKENIZER = dataclasses.replace(QWEN_TOKENIZER, tail=QWEN_TOKENIZER.tail + VISION_TOKENS)

# mrope: frequencies (head_dim / 2) for temporal, height, width; tiny's moe_inter 96: neither stacked expert tensor
# is square (so its layout is told by its shape) and MXFP4 (32-value blocks) holds them
SIZES = {
    "tiny": {"hidden": 64, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 16, "experts": 8, "top_k": 2,
             "moe_inter": 96, "mrope": [2, 3, 3], "v_hidden": 32, "v_depth": 3, "v_heads": 2, "v_inter": 48,
             "v_patch": 4, "v_pos": 16, "deepstack": [0, 2], "min_pixels": 4096, "max_pixels": 65536},
    "small": {"hidden": 1024, "layers": 6, "heads": 16, "kv_heads": 4, "head_dim": 64, "experts": 16, "top_k": 4,
              "moe_inter": 512, "vocab": 32768, "mrope": [12, 10, 10], "v_hidden": 256, "v_depth": 6, "v_heads": 4, "v_inter": 512,
              "v_patch": 16, "v_pos": 256, "deepstack": [1, 3, 5], "min_pixels": 65536, "max_pixels": 16777216},
    "large": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 64, "top_k": 8,
              "moe_inter": 768, "vocab": 32768, "mrope": [24, 20, 20], "v_hidden": 1152, "v_depth": 12, "v_heads": 16,
              "v_inter": 4304, "v_patch": 16, "v_pos": 2304, "deepstack": [3, 7, 11], "min_pixels": 65536,
              "max_pixels": 16777216},
}


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E, Im = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"], d["moe_inter"]
    Hq, Hkv, hd = d["heads"], d["kv_heads"], d["head_dim"]
    m = "model.language_model."
    t = [tensor(m + "embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p, a = f"{m}layers.{i}", f"{m}layers.{i}.self_attn"
        t += [*norm(f"{p}.input_layernorm", D), *norm(f"{p}.post_attention_layernorm", D),
              *linear(f"{a}.q_proj", Hq * hd, D), *linear(f"{a}.k_proj", Hkv * hd, D),
              *linear(f"{a}.v_proj", Hkv * hd, D), *linear(f"{a}.o_proj", D, Hq * hd),
              *norm(f"{a}.q_norm", hd), *norm(f"{a}.k_norm", hd), *linear(f"{p}.mlp.gate", E, D),
              tensor(f"{p}.mlp.experts.gate_up_proj", (E, D, 2 * Im), normal(), expert=True),
              tensor(f"{p}.mlp.experts.down_proj", (E, Im, D), normal(), expert=True)]
    t += norm(m + "norm", D) + linear("lm_head", V, D)
    vision = {"model_type": "qwen3_vl_moe", "depth": d["v_depth"], "hidden_size": d["v_hidden"],
              "hidden_act": "gelu_pytorch_tanh", "intermediate_size": d["v_inter"], "num_heads": d["v_heads"],
              "in_channels": 3, "patch_size": d["v_patch"], "spatial_merge_size": 2, "temporal_patch_size": 2,
              "out_hidden_size": D, "num_position_embeddings": d["v_pos"],
              "deepstack_visual_indexes": d["deepstack"], "initializer_range": 0.02}
    for name, shape in vision_qwen3vl.tensors(vision_qwen3vl.Config.from_hf(vision), "model.visual.").items():
        is_norm = "norm" in name and name.endswith(".weight")
        t.append(tensor(name, shape, norm_weight() if is_norm else normal(0.02)))
    text_config = {
        "model_type": "qwen3_vl_moe_text", "vocab_size": V, "hidden_size": D, "intermediate_size": 4 * D,
        "moe_intermediate_size": Im, "num_hidden_layers": L, "num_attention_heads": Hq, "num_key_value_heads": Hkv,
        "head_dim": hd, "attention_bias": False, "attention_dropout": 0.0, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_experts": E, "num_experts_per_tok": d["top_k"], "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "initializer_range": 0.02, "max_position_embeddings": 262144,
        "rope_scaling": {"rope_type": "default", "mrope_section": d["mrope"], "mrope_interleaved": True},
        "rope_theta": 5000000.0, "tie_word_embeddings": False, "use_cache": True,
        "bos_token_id": tok.id("<|endoftext|>"), "eos_token_id": tok.id(tok.eos), "dtype": "bfloat16",
    }
    config = {
        "architectures": ["Qwen3VLMoeForConditionalGeneration"], "model_type": "qwen3_vl_moe",
        "text_config": text_config, "vision_config": vision, "image_token_id": tok.id("<|image_pad|>"),
        "video_token_id": tok.id("<|video_pad|>"), "vision_start_token_id": tok.id("<|vision_start|>"),
        "vision_end_token_id": tok.id("<|vision_end|>"), "tie_word_embeddings": False, "dtype": "bfloat16",
    }
    return config, t


def preprocessor(d: dict[str, Any]) -> dict[str, Any]:
    """preprocessor_config.json as Qwen ships it (tiny: a pixel budget for its 4-pixel patches: 64 to 1024 tokens)."""
    return {"preprocessor_config.json": {
        "image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
        "size": {"shortest_edge": d["min_pixels"], "longest_edge": d["max_pixels"]}, "patch_size": d["v_patch"],
        "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
        "do_resize": True, "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True,
        "do_convert_rgb": True}}


FAMILY = CheckpointGenerator("qwen3_vl_moe", build, SIZES, TOKENIZER, files=preprocessor)
