"""Qwen3-Next (`qwen3_next`): Gated DeltaNet layers + gated full attention every
`full_attention_interval` layers; softmax-routed MoE with one gated shared expert.

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`.
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family
from localmoe.models.moe_config import require


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(layers)]
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    heads = require(config, "num_attention_heads")
    return ModelSpec(
        model_type="qwen3_next", family="qwen3_next",
        vocab_size=require(config, "vocab_size"),
        hidden_size=require(config, "hidden_size"),
        num_layers=layers, num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate_size=require(config, "intermediate_size"),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        max_position_embeddings=config.get("max_position_embeddings", 262144),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_kinds=tuple("attention" if t == "full_attention" else "gated_delta" for t in types),
        mlp_kinds=tuple("dense" if i in dense or (i + 1) % step else "moe" for i in range(layers)),
        num_experts=require(config, "num_experts"),
        num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        num_shared_experts=1 if config.get("shared_expert_intermediate_size") else 0,
    )


_EXPERT = "model.layers.{i}.mlp.experts.{e}"

FAMILY = register(Family(
    name="qwen3_next",
    model_types=("qwen3_next",),
    gguf_architectures=(),
    spec_from_hf=spec_from_hf,
    experts=ExpertTensors("bf16", {"gate": f"{_EXPERT}.gate_proj.weight", "up": f"{_EXPERT}.up_proj.weight",
                                   "down": f"{_EXPERT}.down_proj.weight"}),
))
