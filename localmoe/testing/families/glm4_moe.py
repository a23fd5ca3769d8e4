"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`, transformers `Glm4MoeForCausalLM`), as Z.ai ships it on the Hub.

GQA attention with q/k/v biases (`attention_bias`), per-head q/k norms (`use_qk_norm`, GLM-4.5's; the
Air model has none), RoPE on the first half of each head; `first_k_dense_replace` dense layers, then MoE
layers: router `mlp.gate` [E, D] with the fp32 `e_score_correction_bias`, one tensor per expert and
matrix, one shared expert. The appended MTP layer (`num_nextn_predict_layers`) is written as the Hub
has it, `model.layers.{num_hidden_layers}.*` (a whole decoder layer plus `eh_proj`, `enorm`, `hnorm`,
`shared_head.norm`), although transformers never loads it. Widths are multiples of 256 even at `tiny`,
so every GGUF block type can hold these matrices (`localmoe.testing.moe_gguf`).
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.families.glm5_next import TOKENIZER
from localmoe.testing.layers import experts, linear, norm, router, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

SIZES = {
    "tiny": {"hidden": 256, "layers": 3, "heads": 4, "kv_heads": 2, "head_dim": 64, "experts": 8, "top_k": 2,
             "moe_inter": 256, "inter": 512, "dense_layers": 1, "qk_norm": True},
    "small": {"hidden": 1024, "layers": 6, "heads": 16, "kv_heads": 4, "head_dim": 64, "experts": 16, "top_k": 4,
              "moe_inter": 512, "inter": 2048, "dense_layers": 1, "qk_norm": False, "vocab": 32768},
    "large": {"hidden": 2048, "layers": 16, "heads": 32, "kv_heads": 4, "head_dim": 128, "experts": 64, "top_k": 8,
              "moe_inter": 768, "inter": 6144, "dense_layers": 1, "qk_norm": True, "vocab": 32768},
}


def _layer(p: str, d: dict[str, Any], moe: bool) -> list[TensorSpec]:
    D, E, Hq, Hkv, hd = d["hidden"], d["experts"], d["heads"], d["kv_heads"], d["head_dim"]
    a = f"{p}.self_attn"
    t = [*norm(f"{p}.input_layernorm", D), *norm(f"{p}.post_attention_layernorm", D),
         *linear(f"{a}.q_proj", Hq * hd, D, bias=True), *linear(f"{a}.k_proj", Hkv * hd, D, bias=True),
         *linear(f"{a}.v_proj", Hkv * hd, D, bias=True), *linear(f"{a}.o_proj", D, Hq * hd)]
    if d["qk_norm"]:
        t += [*norm(f"{a}.q_norm", hd), *norm(f"{a}.k_norm", hd)]
    if not moe:
        return t + swiglu(f"{p}.mlp", D, d["inter"])
    return t + [*router(f"{p}.mlp.gate", E, D), *experts(f"{p}.mlp.experts", E, D, d["moe_inter"]),
                *swiglu(f"{p}.mlp.shared_experts", D, d["moe_inter"])]


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size)
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        t += _layer(f"model.layers.{i}", d, i >= d["dense_layers"])
    mtp = f"model.layers.{L}"  # the MTP layer: read by no runtime here
    t += _layer(mtp, d, True) + [*linear(f"{mtp}.eh_proj", D, 2 * D), *norm(f"{mtp}.enorm", D),
                                 *norm(f"{mtp}.hnorm", D), *norm(f"{mtp}.shared_head.norm", D)]
    t += norm("model.norm", D) + linear("lm_head", V, D)
    config = {
        "architectures": ["Glm4MoeForCausalLM"],
        "model_type": "glm4_moe",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": L,
        "num_nextn_predict_layers": 1,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "partial_rotary_factor": 0.5,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "use_qk_norm": d["qk_norm"],
        "n_routed_experts": d["experts"],
        "n_shared_experts": 1,
        "num_experts_per_tok": d["top_k"],
        "first_k_dense_replace": d["dense_layers"],
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "max_position_embeddings": 131072,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": [tok.id(tok.eos), tok.id("<|user|>"), tok.id("<|observation|>")],
        "pad_token_id": tok.id(tok.pad),
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("glm4_moe", build, SIZES, TOKENIZER)
