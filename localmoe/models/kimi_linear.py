"""Kimi-Linear (`kimi_linear`): KDA delta-rule layers + MLA every few layers, sigmoid-routed MoE.

Checkpoint facts: layer lists in `linear_attn_config` are 1-indexed; routed experts are
per-expert bf16 `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down). The engine for
this family lands with the MoE engine; today checkpoints convert and inspect.
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.engine.kda import KDAConfig
from localmoe.engine.mla import MLAConfig
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family
from localmoe.models.moe_config import kinds_from_one_indexed, moe_placement, require


def text_spec(config: dict, model_type: str, family: str, source: str = "config.json") -> ModelSpec:
    """ModelSpec from a Kimi-Linear-style text config (also K3's `text_config`)."""
    layers = require(config, "num_hidden_layers", source)
    linear = require(config, "linear_attn_config", source)
    kinds = kinds_from_one_indexed(layers, {"kda": linear.get("kda_layers", []),
                                            "mla": linear.get("full_attn_layers", [])}, source)
    latent = config.get("routed_expert_hidden_size") is not None
    heads = require(config, "num_attention_heads", source)
    return ModelSpec(
        model_type=model_type, family=family,
        vocab_size=require(config, "vocab_size", source),
        hidden_size=require(config, "hidden_size", source),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("v_head_dim") or linear.get("head_dim"),
        intermediate_size=require(config, "intermediate_size", source),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("model_max_length") or config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        layer_kinds=kinds,
        mlp_kinds=moe_placement(layers, config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1),
                                "latent_moe" if latent else "moe"),
        num_experts=require(config, "num_experts", source),
        num_experts_per_tok=require(config, "num_experts_per_token", source),
        moe_intermediate_size=require(config, "moe_intermediate_size", source),
        num_shared_experts=config.get("num_shared_experts", 0),
        **KDAConfig.from_hf(config, family).spec_fields(),
        **MLAConfig.from_hf(config).spec_fields(),
    )


def spec_from_hf(config: dict) -> ModelSpec:
    return text_spec(config, "kimi_linear", "kimi_linear")


_EXPERT = "model.layers.{i}.block_sparse_moe.experts.{e}"

FAMILY = register(Family(
    name="kimi_linear",
    model_types=("kimi_linear",),
    gguf_architectures=(),
    spec_from_hf=spec_from_hf,
    experts=ExpertTensors("bf16", {"gate": f"{_EXPERT}.w1.weight", "up": f"{_EXPERT}.w3.weight",
                                   "down": f"{_EXPERT}.w2.weight"}),
))
