"""Qwen3-MoE (`qwen3_moe`: Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 attention with MoE MLPs.

Checkpoint facts (the Hub layout; transformers 5 writes it back on save): attention as dense Qwen3
(q/k/v/o without biases, per-head RMSNorm of q and k before RoPE), router `mlp.gate.weight` [E, D],
experts per id `mlp.experts.{e}.{gate,up,down}_proj.weight` (bf16, [I, D] / [D, I]). Layers listed in
`mlp_only_layers`, or off the `decoder_sparse_step` stride, have a dense SiLU MLP instead.

Quirks, each covered by tests/models/test_qwen3_moe.py: softmax over all experts, top-k, the chosen
weights renormalised when `norm_topk_prob`; no shared expert; SwiGLU experts.

GGUF (`qwen3moe`, llama.cpp's layout; tests/models/test_moe_gguf.py): experts stacked per layer as
`blk.N.ffn_{gate,up,down}_exps.weight` in any ggml type, split per expert on load (models/gguf_experts.py);
llama.cpp always renormalises the chosen weights (`expert_weights_norm` overrides when written); a layer
without `ffn_gate_inp` is dense. q/k rows are not permuted (NeoX RoPE).
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.engine.layers.attention import GQA_TENSORS, gqa_fields_from_hf
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule, hf_rules
from localmoe.models.gguf_experts import GGUFKeys, gguf_moe_tensors, gguf_stacked_experts, unstack_experts
from localmoe.models.moe_config import require


def _experts(config: dict) -> int:
    """`num_experts` on the Hub; transformers 5 writes `num_local_experts`."""
    return int(config.get("num_experts") or require(config, "num_local_experts"))


def _moe_layer(config: dict, i: int) -> bool:
    step = config.get("decoder_sparse_step", 1) or 1
    return i not in (config.get("mlp_only_layers") or ()) and _experts(config) > 0 and (i + 1) % step == 0


def spec_from_hf(config: dict) -> ModelSpec:
    attention = gqa_fields_from_hf(config, "qwen3")  # the attention is Qwen3's
    layers = config["num_hidden_layers"]
    return ModelSpec(
        model_type="qwen3_moe", family="qwen3_moe",
        vocab_size=config["vocab_size"], hidden_size=config["hidden_size"], num_layers=layers,
        intermediate_size=config["intermediate_size"], rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"), name=config.get("_name_or_path", ""),
        mlp_kinds=tuple("moe" if _moe_layer(config, i) else "dense" for i in range(layers)),
        num_experts=_experts(config), num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        norm_topk_prob=bool(config.get("norm_topk_prob", False)), scoring_func="softmax", expert_act="swiglu",
        **attention,
    )


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `qwen3moe.*` metadata was converted from."""
    key = GGUFKeys(metadata, "qwen3moe")
    layers = key("block_count")
    heads = key("attention.head_count")
    config = {
        "model_type": "qwen3_moe", "_name_or_path": metadata.get("general.name", ""),
        "num_hidden_layers": layers, "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length", 0), "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": key("attention.head_count_kv", heads),
        "head_dim": key("attention.key_length", key("embedding_length") // heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 1e6),
        "rope_scaling": key.rope_scaling(), "max_position_embeddings": key("context_length", 40960),
        "vocab_size": key.vocab_size(), "num_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),  # llama.cpp's qwen3moe graph always renormalises
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return spec_from_hf(config)


_PROJECTIONS = ("gate", "up", "down")

HF_TENSORS = TensorMap(
    rules=(
        *hf_rules(("input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{t}" for t in GQA_TENSORS),
                   *(f"mlp.{p}_proj.weight" for p in _PROJECTIONS))),
        TensorRule("model.layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *(TensorRule(f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{p}.weight")
          for p in _PROJECTIONS),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)


_GGUF_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
               **{f"attn_{'output' if p == 'o' else p}.weight": f"self_attn.{p}_proj.weight" for p in "qkvo"},
               "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
               "ffn_gate_inp.weight": "mlp.router.weight",
               **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in _PROJECTIONS}}


def gguf_tensors(architecture: str) -> TensorMap:
    return gguf_moe_tensors(_GGUF_LAYER)


FAMILY = register(ModelFamily(
    name="qwen3_moe", model_types=("qwen3_moe",), spec_from_hf=spec_from_hf, hf_tensors=HF_TENSORS,
    experts=ExpertTensors("bf16", {p: f"model.layers.{{i}}.mlp.experts.{{e}}.{p}_proj.weight" for p in _PROJECTIONS}),
    gguf_architectures=("qwen3moe",), spec_from_gguf=spec_from_gguf, gguf_tensors=gguf_tensors,
    gguf_finish=unstack_experts, gguf_experts=gguf_stacked_experts()))
