"""Qwen3-MoE (`qwen3_moe`, transformers `Qwen3MoeForCausalLM`), as Qwen ships it on the Hub.

Qwen3 attention (q/k/v/o without biases, per-head `q_norm` / `k_norm`), a router `mlp.gate`
[E, D] and one tensor per expert and matrix (`mlp.experts.{e}.{gate,up,down}_proj.weight`), no
shared expert; every layer is MoE (llama.cpp's `qwen3moe` graph has no dense layers). Widths are multiples of 256 even at `tiny`, so every
GGUF block type, the 256-value K-quants included, can hold these matrices
(`localmoe.testing.moe_gguf`).
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.families.qwen3_next import TOKENIZER
from localmoe.testing.layers import experts, linear, norm, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

SIZES = {
    "tiny": {"hidden": 256, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 64, "experts": 8, "top_k": 2,
             "moe_inter": 256, "inter": 512},
    "small": {"hidden": 1024, "layers": 6, "heads": 16, "kv_heads": 4, "head_dim": 64, "experts": 16, "top_k": 4,
              "moe_inter": 512, "inter": 2048, "vocab": 32768},
    "large": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 64, "top_k": 8,
              "moe_inter": 768, "inter": 6144, "vocab": 32768},
}


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    Hq, Hkv, hd = d["heads"], d["kv_heads"], d["head_dim"]
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"model.layers.{i}"
        a = f"{p}.self_attn"
        t += [*norm(f"{p}.input_layernorm", D), *norm(f"{p}.post_attention_layernorm", D),
              *linear(f"{a}.q_proj", Hq * hd, D), *linear(f"{a}.k_proj", Hkv * hd, D),
              *linear(f"{a}.v_proj", Hkv * hd, D), *linear(f"{a}.o_proj", D, Hq * hd),
              *norm(f"{a}.q_norm", hd), *norm(f"{a}.k_norm", hd)]
        t += [*linear(f"{p}.mlp.gate", E, D), *experts(f"{p}.mlp.experts", E, D, d["moe_inter"])]
    t += norm("model.norm", D) + linear("lm_head", V, D)
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": L,
        "num_attention_heads": Hq,
        "num_key_value_heads": Hkv,
        "head_dim": hd,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_experts": E,
        "num_experts_per_tok": d["top_k"],
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.02,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "use_sliding_window": False,
        "bos_token_id": tok.id("<|endoftext|>"),
        "eos_token_id": tok.id(tok.eos),
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("qwen3_moe", build, SIZES, TOKENIZER)
