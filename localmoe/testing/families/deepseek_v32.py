"""DeepSeek-V3.2 (`deepseek_v32`, transformers `DeepseekV32ForCausalLM`), bf16.

MLA with q LoRA and RoPE on `qk_rope_head_dim`, plus the DSA lightning indexer
(`self_attn.indexer.{wq_b, wk, k_norm (LayerNorm: weight + bias), weights_proj}`) in every
layer; the first `first_k_dense_replace` layers are dense, the rest MoE with sigmoid
group-limited routing (`mlp.gate.weight`, fp32 `mlp.gate.e_score_correction_bias`),
per-expert `mlp.experts.{e}.{gate,up,down}_proj` and `mlp.shared_experts`. The released
weights are FP8 with `weight_scale_inv` blocks and carry an MTP layer; this checkpoint is
the bf16 form without MTP (`num_nextn_predict_layers` 0).
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import dsa_indexer, experts, linear, mla, norm, router, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"

# DeepSeek-V3.1/V3.2 non-thinking chat: system text after BOS, then User/Assistant turns.
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages if message['role'] == 'system' -%}{{- message['content'] -}}{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}<｜User｜>{{- message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}<｜Assistant｜></think>{{- message['content'] -}}<｜end▁of▁sentence｜>"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<｜Assistant｜></think>{%- endif -%}"
)

TOKENIZER = TokenizerLayout(
    head=(BOS, EOS, PAD), tail=("<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"),
    chat_template=CHAT_TEMPLATE, bos=BOS, eos=EOS, pad=PAD, add_bos_token=True,
    not_special=frozenset({"<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"}))

_COMMON = {"first_dense": 1, "shared": 1}
SIZES = {
    "tiny": dict(_COMMON, hidden=64, layers=4, heads=4, q_lora=32, kv_lora=32, nope=16, rope=8, v=16, index_heads=2,
                 index_dim=16, index_topk=4, inter=128, moe_inter=32, experts=8, top_k=2, n_group=2, topk_group=1),
    "small": dict(_COMMON, hidden=768, layers=8, heads=8, q_lora=384, kv_lora=256, nope=64, rope=32, v=64,
                  index_heads=4, index_dim=64, index_topk=64, inter=2048, moe_inter=384, experts=32, top_k=4,
                  n_group=4, topk_group=2, vocab=32768),
    "large": dict(_COMMON, hidden=2048, layers=12, heads=16, q_lora=768, kv_lora=512, nope=128, rope=64, v=128,
                  index_heads=8, index_dim=128, index_topk=512, inter=8192, moe_inter=1024, experts=64, top_k=8,
                  n_group=8, topk_group=4, vocab=32768),
}


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"model.layers.{i}"
        t += norm(f"{p}.input_layernorm", D) + norm(f"{p}.post_attention_layernorm", D)
        t += mla(f"{p}.self_attn", D, d["heads"], q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
                 qk_nope=d["nope"], qk_rope=d["rope"], v_dim=d["v"])
        t += dsa_indexer(f"{p}.self_attn.indexer", D, d["q_lora"], d["index_heads"], d["index_dim"])
        if i < d["first_dense"]:
            t += swiglu(f"{p}.mlp", D, d["inter"])
        else:
            t += router(f"{p}.mlp.gate", E, D)
            t += experts(f"{p}.mlp.experts", E, D, d["moe_inter"])
            t += swiglu(f"{p}.mlp.shared_experts", D, d["moe_inter"] * d["shared"])
    t += norm("model.norm", D) + linear("lm_head", V, D)

    config = {
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": L,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "index_n_heads": d["index_heads"],
        "index_head_dim": d["index_dim"],
        "index_topk": d["index_topk"],
        "n_routed_experts": E,
        "n_shared_experts": d["shared"],
        "num_experts_per_tok": d["top_k"],
        "first_k_dense_replace": d["first_dense"],
        "moe_layer_freq": 1,
        "n_group": d["n_group"],
        "topk_group": d["topk_group"],
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "max_position_embeddings": 163840,
        "rope_theta": 10000,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096, "type": "yarn"},
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tok.id(tok.bos),
        "eos_token_id": tok.id(tok.eos),
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("deepseek_v32", build, SIZES, TOKENIZER)


def build_v3(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    """DeepSeek-V3 (`deepseek_v3`, transformers `DeepseekV3ForCausalLM`): V3.2 without the indexer."""
    config, tensors = build(d, tok)
    for key in ("index_n_heads", "index_head_dim", "index_topk"):
        del config[key]
    config.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3")
    return config, [t for t in tensors if ".indexer." not in t.name]


V3 = CheckpointGenerator("deepseek_v3", build_v3, SIZES, TOKENIZER)
