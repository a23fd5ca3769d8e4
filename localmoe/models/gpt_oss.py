"""gpt-oss (`gpt_oss`): GQA with alternating sliding-window / full layers and sinks; MXFP4 MoE.

Checkpoint facts: experts stacked per layer as MXFP4 `mlp.experts.gate_up_proj_blocks`
[E, 2I, D/32, 16] / `_scales` [E, 2I, D/32] / `_bias` [E, 2I] with gate and up rows
interleaved (gate = even rows), and `down_proj_*` likewise.
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family
from localmoe.models.moe_config import require


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
    heads = require(config, "num_attention_heads")
    return ModelSpec(
        model_type="gpt_oss", family="gpt_oss",
        vocab_size=require(config, "vocab_size"),
        hidden_size=require(config, "hidden_size"),
        num_layers=layers, num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=require(config, "intermediate_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=float(config.get("rope_theta", 150000.0)),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", True)),
        layer_kinds=tuple("sliding_attention" if t == "sliding_attention" else "attention" for t in types),
        mlp_kinds=("moe",) * layers,
        num_experts=require(config, "num_local_experts"),
        num_experts_per_tok=config.get("num_experts_per_tok") or config.get("experts_per_token"),
        moe_intermediate_size=require(config, "intermediate_size"),
    )


FAMILY = register(Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    gguf_architectures=(),
    spec_from_hf=spec_from_hf,
    experts=ExpertTensors("gpt_oss_mxfp4", {"gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
                                            "down": "model.layers.{i}.mlp.experts.down_proj"}, stacked=True),
))
