"""DeepSeek-V3.2 (`deepseek_v32`) and GLM-5-Next (`glm5_next`): MLA with the DSA lightning
indexer (GLM-5-Next adds KDA-style linear layers), sigmoid-routed MoE with correction bias
and group-limited top-k.

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`
(GLM-5-Next under `model.language_model.`; its text config is `text_config`).
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.models import register
from localmoe.models.base import ExpertTensors, Family
from localmoe.models.moe_config import moe_placement, require


def _spec(config: dict, model_type: str, layer_kinds, mlp_kinds, source: str) -> ModelSpec:
    heads = require(config, "num_attention_heads", source)
    return ModelSpec(
        model_type=model_type, family=model_type,
        vocab_size=require(config, "vocab_size", source),
        hidden_size=require(config, "hidden_size", source),
        num_layers=require(config, "num_hidden_layers", source), num_heads=heads,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=require(config, "v_head_dim", source),
        intermediate_size=require(config, "intermediate_size", source),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", 10000.0)),
        rope_scaling=config.get("rope_scaling"),
        max_position_embeddings=config.get("max_position_embeddings", 163840),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        layer_kinds=layer_kinds, mlp_kinds=mlp_kinds,
        num_experts=require(config, "n_routed_experts", source),
        num_experts_per_tok=require(config, "num_experts_per_tok", source),
        moe_intermediate_size=require(config, "moe_intermediate_size", source),
        num_shared_experts=config.get("n_shared_experts", 0),
    )


def deepseek_spec(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    return _spec(config, "deepseek_v32", ("dsa",) * layers,
                 moe_placement(layers, config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)),
                 "config.json")


def glm5_spec(config: dict) -> ModelSpec:
    source = "config.json text_config"
    text = require(config, "text_config")
    kinds = {"linear_attention": "kda", "indexed_attention": "dsa", "full_attention": "mla"}
    mlp = {"dense": "dense", "sparse": "moe"}
    return _spec(text, "glm5_next", tuple(kinds[t] for t in require(text, "layer_types", source)),
                 tuple(mlp[t] for t in require(text, "mlp_layer_types", source)), source)


def _experts(prefix: str) -> ExpertTensors:
    stem = prefix + "layers.{i}.mlp.experts.{e}"
    return ExpertTensors("bf16", {"gate": f"{stem}.gate_proj.weight", "up": f"{stem}.up_proj.weight",
                                  "down": f"{stem}.down_proj.weight"})


DEEPSEEK = register(Family(name="deepseek_v32", model_types=("deepseek_v32",), gguf_architectures=(),
                           spec_from_hf=deepseek_spec, experts=_experts("model.")))
GLM5 = register(Family(name="glm5_next", model_types=("glm5_next",), gguf_architectures=(),
                       spec_from_hf=glm5_spec, experts=_experts("model.language_model.")))
