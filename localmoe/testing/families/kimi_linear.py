"""Kimi-Linear (`kimi_linear`, transformers `KimiLinearForCausalLM`), as Moonshot ships it.

On disk (transformers renames at load time): MoE blocks are `block_sparse_moe` with
per-expert `w1` (gate) / `w3` (up) / `w2` (down); the KDA forget gate (`f_a_proj`,
`f_b_proj`, `A_log` [1, 1, H, 1], `dt_bias`) sits directly under `self_attn`; q/k/v have
separate depthwise convs. MLA layers have no q LoRA (`q_proj`), NoPE. Layer lists in
`linear_attn_config` are 1-indexed.
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import experts, kda, linear, mla, norm, router, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|im_system|>system<|im_middle|>"
    "{%- elif message['role'] == 'user' -%}<|im_user|>user<|im_middle|>"
    "{%- elif message['role'] == 'tool' -%}<|im_system|>tool<|im_middle|>"
    "{%- else -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- endif -%}"
    "{{- message['content'] -}}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

TOKENIZER = TokenizerLayout(
    tail=("[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>",
          "[PAD]"),
    chat_template=CHAT_TEMPLATE, bos="[BOS]", eos="<|im_end|>", pad="[PAD]", stop=("[EOS]",))

_COMMON = {"kda_conv": 4, "q_lora_rank": None, "first_dense": 1, "shared": 1, "scaling": 2.446}
SIZES = {
    "tiny": dict(_COMMON, hidden=64, layers=4, full_attn_layers=[4], heads=4, kda_heads=4, kda_head_dim=16,
                 kv_lora=32, nope=16, rope=8, v=16, inter=128, moe_inter=32, experts=8, top_k=2),
    "small": dict(_COMMON, hidden=768, layers=8, full_attn_layers=[4, 8], heads=8, kda_heads=8, kda_head_dim=64,
                  kv_lora=256, nope=64, rope=32, v=64, inter=2048, moe_inter=384, experts=32, top_k=4, vocab=32768),
    "large": dict(_COMMON, hidden=2048, layers=12, full_attn_layers=[4, 8, 12], heads=16, kda_heads=16,
                  kda_head_dim=128, kv_lora=512, nope=128, rope=64, v=128, inter=8192, moe_inter=1024, experts=64,
                  top_k=8, vocab=32768),
}


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    full = set(d["full_attn_layers"])
    H, K = d["kda_heads"], d["kda_head_dim"]
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"model.layers.{i}"
        t += norm(f"{p}.input_layernorm", D) + norm(f"{p}.post_attention_layernorm", D)
        if i + 1 in full:
            t += mla(f"{p}.self_attn", D, d["heads"], q_lora_rank=d["q_lora_rank"], kv_lora_rank=d["kv_lora"],
                     qk_nope=d["nope"], qk_rope=d["rope"], v_dim=d["v"])
        else:
            t += kda(f"{p}.self_attn", D, H, K, d["kda_conv"], a_log_shape=(1, 1, H, 1))
        if i < d["first_dense"]:
            t += swiglu(f"{p}.mlp", D, d["inter"])
        else:
            moe = f"{p}.block_sparse_moe"
            t += router(f"{moe}.gate", E, D)
            t += experts(f"{moe}.experts", E, D, d["moe_inter"], ("w1", "w3", "w2"))
            t += swiglu(f"{moe}.shared_experts", D, d["moe_inter"] * d["shared"])
    t += norm("model.norm", D) + linear("lm_head", V, D)

    config = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": L,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora_rank"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "mla_use_nope": True,
        "linear_attn_config": {
            "full_attn_layers": sorted(full),
            "kda_layers": [i for i in range(1, L + 1) if i not in full],
            "num_heads": H,
            "head_dim": K,
            "short_conv_kernel_size": d["kda_conv"],
        },
        "num_experts": E,
        "num_experts_per_token": d["top_k"],
        "num_shared_experts": d["shared"],
        "first_k_dense_replace": d["first_dense"],
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": d["scaling"],
        "num_expert_group": 1,
        "topk_group": 1,
        "use_grouped_topk": True,
        "num_nextn_predict_layers": 0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tok.id(tok.bos),
        "eos_token_id": tok.id(tok.eos),
        "pad_token_id": tok.id(tok.pad),
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("kimi_linear", build, SIZES, TOKENIZER)
