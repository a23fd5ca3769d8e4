"""Qwen3-Next (`qwen3_next`, transformers `Qwen3NextForCausalLM`), as Qwen ships it.

Gated DeltaNet layers (`linear_attn`: fused `in_proj_qkvz` / `in_proj_ba`, one conv over
q|k|v, per-value-head `A_log` / `dt_bias`, gated RMSNorm `norm`) with a gated full
attention layer every `full_attention_interval` layers (q_proj is twice wide: query and
gate; per-head q_norm / k_norm; partial RoPE). Per-expert MoE plus one shared expert with
a sigmoid `shared_expert_gate`. The decoder RMSNorms compute `x * (1 + w)`, so their
stored weights are near 0; the gated `linear_attn.norm` is a plain `x * w`.
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import F32, experts, linear, norm, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import dt_bias, log_uniform, normal
from localmoe.testing.tokenizer import TokenizerLayout

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

TOKENIZER = TokenizerLayout(
    tail=("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"),
    chat_template=CHAT_TEMPLATE, eos="<|im_end|>", pad="<|endoftext|>", stop=("<|endoftext|>",),
    not_special=frozenset({"<tool_call>", "</tool_call>", "<think>", "</think>"}))

SIZES = {
    "tiny": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "lin_k_heads": 2, "lin_v_heads": 4,
             "lin_k_dim": 16, "lin_v_dim": 16, "experts": 8, "top_k": 2, "moe_inter": 32, "shared_inter": 32},
    "small": {"hidden": 768, "layers": 8, "heads": 8, "kv_heads": 2, "head_dim": 128, "lin_k_heads": 4,
              "lin_v_heads": 8, "lin_k_dim": 64, "lin_v_dim": 64, "experts": 32, "top_k": 4, "moe_inter": 384,
              "shared_inter": 384, "vocab": 32768},
    "large": {"hidden": 2048, "layers": 12, "heads": 16, "kv_heads": 2, "head_dim": 128, "lin_k_heads": 8,
              "lin_v_heads": 16, "lin_k_dim": 128, "lin_v_dim": 128, "experts": 64, "top_k": 8, "moe_inter": 1024,
              "shared_inter": 1024, "vocab": 32768},
}
INTERVAL = 4  # full_attention_interval


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    Hk, Hv, Dk, Dv = d["lin_k_heads"], d["lin_v_heads"], d["lin_k_dim"], d["lin_v_dim"]
    Hq, Hkv, hd = d["heads"], d["kv_heads"], d["head_dim"]
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"model.layers.{i}"
        t += norm(f"{p}.input_layernorm", D, zero_centred=True)
        t += norm(f"{p}.post_attention_layernorm", D, zero_centred=True)
        if (i + 1) % INTERVAL:
            a = f"{p}.linear_attn"
            t += [*linear(f"{a}.in_proj_qkvz", 2 * Hk * Dk + 2 * Hv * Dv, D), *linear(f"{a}.in_proj_ba", 2 * Hv, D),
                  tensor(f"{a}.conv1d.weight", (2 * Hk * Dk + Hv * Dv, 1, 4), normal(0.3)),
                  tensor(f"{a}.A_log", (Hv,), log_uniform(1.0, 16.0), F32),
                  tensor(f"{a}.dt_bias", (Hv,), dt_bias()),
                  *norm(f"{a}.norm", Dv, dtype=F32), *linear(f"{a}.out_proj", D, Hv * Dv)]
        else:
            a = f"{p}.self_attn"
            t += [*linear(f"{a}.q_proj", 2 * Hq * hd, D), *linear(f"{a}.k_proj", Hkv * hd, D),
                  *linear(f"{a}.v_proj", Hkv * hd, D), *linear(f"{a}.o_proj", D, Hq * hd),
                  *norm(f"{a}.q_norm", hd, zero_centred=True), *norm(f"{a}.k_norm", hd, zero_centred=True)]
        m = f"{p}.mlp"
        t += linear(f"{m}.gate", E, D)
        t += experts(f"{m}.experts", E, D, d["moe_inter"])
        t += swiglu(f"{m}.shared_expert", D, d["shared_inter"])
        t += linear(f"{m}.shared_expert_gate", 1, D)
    t += norm("model.norm", D, zero_centred=True) + linear("lm_head", V, D)

    config = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": 4 * D,
        "num_hidden_layers": L,
        "num_attention_heads": Hq,
        "num_key_value_heads": Hkv,
        "head_dim": hd,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "full_attention_interval": INTERVAL,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": Dk,
        "linear_value_head_dim": Dv,
        "linear_num_key_heads": Hk,
        "linear_num_value_heads": Hv,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": E,
        "num_experts_per_tok": d["top_k"],
        "moe_intermediate_size": d["moe_inter"],
        "shared_expert_intermediate_size": d["shared_inter"],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "max_position_embeddings": 262144,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000000,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "bos_token_id": tok.id("<|endoftext|>"),
        "eos_token_id": tok.id(tok.eos),
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("qwen3_next", build, SIZES, TOKENIZER)
