"""GLM-4.5 / GLM-4.6 / GLM-4.7 (`glm4_moe`, transformers `Glm4MoeForCausalLM`): GQA attention with q/k/v
biases and RoPE on the first half of each head, DeepSeek-style MoE (sigmoid router with correction bias,
group-limited top-k, shared experts) after `first_k_dense_replace` dense layers.

Checkpoint facts (the Hub layout; transformers 5 writes it back on save): attention
`self_attn.{q,k,v}_proj.{weight,bias}` (`attention_bias`), `o_proj` without bias, `q_norm` / `k_norm`
per head when `use_qk_norm` (GLM-4.5-Air: no); router `mlp.gate.weight` + `mlp.gate.e_score_correction_bias`;
routed experts per id `mlp.experts.{e}.{gate,up,down}_proj.weight`; `mlp.shared_experts.*`.

Quirks, each covered by tests/models/test_glm4_moe.py:
- RoPE on the first `partial_rotary_factor` (0.5 when the config does not say: transformers' default)
  of each head, NeoX halves within that part.
- The MTP layers (`num_nextn_predict_layers`, stored as `model.layers.{num_hidden_layers}...`) are not part
  of the main model (`ModelSpec.nextn_layers`, checkpoint.tensor_names): loaded only for `--spec mtp`
  (load.load_nextn, engine/nextn.py), kept dense by `convert`.

GGUF (`glm4moe`, llama.cpp's layout; tests/models/test_moe_gguf.py): `blk.N.post_attention_norm` is the
post-attention norm, the correction bias `exp_probs_b.bias`, shared experts `ffn_*_shexp`, routed experts
stacked (split per expert, models/gguf_experts.py); `block_count` includes the appended MTP blocks
(`nextn_predict_layers`), whose tensors (`blk.{L}.*`, `blk.{L}.nextn.*`) are left out of the model
(checkpoint.tensor_names) and read for `--spec mtp` (models/base.py NEXTN_GGUF; tests/engine/test_mtp.py); the rotary part is
`rope.dimension_count`. q/k rows are not permuted (NeoX RoPE).
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.engine.layers.attention import GQA_TENSORS, rope_from_hf
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule, hf_rules
from localmoe.models.gguf_experts import MOE_GGUF, GGUFKeys, gguf_moe_tensors, gguf_stacked_experts, unstack_experts
from localmoe.models.moe_config import dims, experts, moe_placement, require

_PARTIAL_ROTARY = 0.5  # transformers' Glm4MoeConfig default


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    theta, scaling = rope_from_hf(config)
    rope = config.get("rope_parameters") or {}
    return ModelSpec(
        model_type="glm4_moe", family="glm4_moe", **dims(config), name=config.get("_name_or_path", ""),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5), rope_theta=theta, rope_scaling=scaling,
        partial_rotary_factor=float(config.get("partial_rotary_factor",
                                               rope.get("partial_rotary_factor", _PARTIAL_ROTARY))),
        attention_bias=bool(config.get("attention_bias", False)), qk_norm=bool(config.get("use_qk_norm", False)),
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), hidden_act=config.get("hidden_act", "silu"),
        mlp_kinds=moe_placement(layers, config.get("first_k_dense_replace", 1)),
        num_experts=require(config, "n_routed_experts"), num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        num_shared_experts=config.get("n_shared_experts", 1), scoring_func="sigmoid",
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        routed_scaling_factor=float(config.get("routed_scaling_factor", 1.0)),
        n_group=int(config.get("n_group") or 1), topk_group=int(config.get("topk_group") or 1),
        nextn_layers=int(config.get("num_nextn_predict_layers", 0) or 0),
    )


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `glm4moe.*` metadata was converted from."""
    key = GGUFKeys(metadata, "glm4moe")
    nextn = key("nextn_predict_layers", 0)
    heads, hidden = key("attention.head_count"), key("embedding_length")
    head_dim = key("attention.key_length", hidden // heads)
    config = {
        "model_type": "glm4_moe", "_name_or_path": metadata.get("general.name", ""),
        "num_hidden_layers": key("block_count") - nextn, "num_nextn_predict_layers": nextn,
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads), "head_dim": head_dim,
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "attention_bias": "blk.0.attn_q.bias" in tensor_names, "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 1e6),
        "rope_scaling": key.rope_scaling(), "max_position_embeddings": key("context_length", 131072),
        "vocab_size": key.vocab_size(), "n_routed_experts": key("expert_count"),
        "n_shared_experts": key("expert_shared_count", 0), "num_experts_per_tok": key("expert_used_count"),
        "first_k_dense_replace": key("leading_dense_block_count", 0),
        "n_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
        "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": key("expert_weights_scale", 1.0),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return spec_from_hf(config)


_PROJ = ("gate", "up", "down")

HF_TENSORS = TensorMap(
    rules=(
        *hf_rules(("input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{t}" for t in GQA_TENSORS),
                   *(f"mlp.{s}{p}_proj.weight" for s in ("", "shared_experts.") for p in _PROJ))),
        TensorRule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        TensorRule("model.layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias"),
        *(TensorRule(f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{p}.weight")
          for p in _PROJ),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)

_GGUF_LAYER = {**MOE_GGUF, "post_attention_norm.weight": "post_attention_layernorm.weight",
               **{f"attn_{'output' if p == 'o' else p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
               **{f"attn_{p}.bias": f"self_attn.{p}_proj.bias" for p in "qkv"},
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight"}


def gguf_tensors(architecture: str) -> TensorMap:
    return gguf_moe_tensors(_GGUF_LAYER)


FAMILY = register(ModelFamily(
    name="glm4_moe", model_types=("glm4_moe",), spec_from_hf=spec_from_hf, hf_tensors=HF_TENSORS,
    experts=experts("model."), gguf_architectures=("glm4moe",), spec_from_gguf=spec_from_gguf,
    gguf_tensors=gguf_tensors, gguf_finish=unstack_experts, gguf_experts=gguf_stacked_experts()))
