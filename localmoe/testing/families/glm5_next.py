"""GLM-5-Next (`glm5_next`, transformers `Glm5NextForConditionalGeneration`; transformers
5.23 has no `Glm5NextForCausalLM`: the model is image-text-to-text).

Text tower under `model.language_model.` (lm_head at the top level), a small vision tower
under `model.visual.` (present so the checkpoint loads without missing keys; a text
runtime skips it). Layers are KDA (`linear_attention`: q/k/v convs stored separately, the
forget gate directly under `self_attn`, `A_log` [H], lower-bounded "safe" gate from
`linear_attn_config.gate_lower_bound`) or MLA with a DSA indexer (`indexed_attention`:
q LoRA, NoPE, k-pool compression `index_kpool_compress_{ape,gate}`). Every layer carries
manifold hyper-connections `hc_{attn,ffn}_{fn,base,scale}` over `hc_mult` streams.
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import F32, dsa_indexer, experts, kda, linear, mla, norm, router, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import const, normal
from localmoe.testing.tokenizer import TokenizerLayout

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'user' -%}<|user|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'tool' -%}<|observation|>\n{{ message['content'] }}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>\n<think></think>\n{{ message['content'] }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|>\n<think></think>\n{% endif -%}"
)

TOKENIZER = TokenizerLayout(
    tail=("<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
          "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
          "<|end_of_video|>", "<|image|>", "<|video|>", "<think>", "</think>"),
    chat_template=CHAT_TEMPLATE, eos="<|endoftext|>", pad="<|endoftext|>", stop=("<|user|>", "<|observation|>"),
    not_special=frozenset({"<think>", "</think>"}))

_COMMON = {"conv": 4, "lower_bound": -5.0, "shared": 1, "patch": 14, "temporal": 2, "merge": 2}
SIZES = {
    "tiny": dict(_COMMON, hidden=64, layers=4, dense_layers=1, heads=4, q_lora=32, kv_lora=32, nope=16, v=16,
                 index_heads=2, index_dim=16, index_topk=4, kpool=2, kda_heads=4, kda_dim=16, hc=2, inter=128,
                 moe_inter=32, experts=8, top_k=2, vis_depth=1, vis_hidden=32, vis_heads=2, vis_inter=64,
                 vis_proj_inter=96),
    "small": dict(_COMMON, hidden=768, layers=8, dense_layers=1, heads=8, q_lora=384, kv_lora=256, nope=64, v=64,
                  index_heads=4, index_dim=64, index_topk=64, kpool=16, kda_heads=8, kda_dim=64, hc=4, inter=2048,
                  moe_inter=384, experts=32, top_k=4, vis_depth=2, vis_hidden=256, vis_heads=4, vis_inter=512,
                  vis_proj_inter=1024, vocab=32768),
    "large": dict(_COMMON, hidden=2048, layers=12, dense_layers=1, heads=16, q_lora=768, kv_lora=512, nope=128,
                  v=128, index_heads=8, index_dim=128, index_topk=512, kpool=16, kda_heads=16, kda_dim=128, hc=4,
                  inter=8192, moe_inter=1024, experts=64, top_k=8, vis_depth=2, vis_hidden=256, vis_heads=4,
                  vis_inter=512, vis_proj_inter=1024, vocab=32768),
}


def _hyper_connection(prefix: str, hc: int, hidden: int) -> list[TensorSpec]:
    n = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc * hc) weights
    return [tensor(f"{prefix}_fn", (n, hc * hidden), normal(0.02)), tensor(f"{prefix}_base", (n,), normal(0.02), F32),
            tensor(f"{prefix}_scale", (3,), const(1.0), F32)]


def _vision(d: dict[str, Any], out: int) -> list[TensorSpec]:
    Vd, p, m = d["vis_hidden"], "model.visual", d["merge"]
    t = [tensor(f"{p}.patch_embed.proj.weight", (Vd, 3, d["temporal"], d["patch"], d["patch"]), normal()),
         tensor(f"{p}.patch_embed.proj.bias", (Vd,), normal())]
    for b in range(d["vis_depth"]):
        q = f"{p}.blocks.{b}"
        t += [*norm(f"{q}.norm1", Vd), *norm(f"{q}.norm2", Vd), *linear(f"{q}.attn.qkv", 3 * Vd, Vd, bias=True),
              *linear(f"{q}.attn.proj", Vd, Vd, bias=True), *norm(f"{q}.attn.q_norm", Vd // d["vis_heads"]),
              *norm(f"{q}.attn.k_norm", Vd // d["vis_heads"]),
              *swiglu(f"{q}.mlp", Vd, d["vis_inter"], bias=True)]
    t += [*linear(f"{p}.merger.proj", out, out), *norm(f"{p}.merger.post_projection_norm", out, bias=True),
          *swiglu(f"{p}.merger", out, d["vis_proj_inter"]),
          tensor(f"{p}.downsample.weight", (out, Vd, m, m), normal()), tensor(f"{p}.downsample.bias", (out,), normal()),
          *norm(f"{p}.post_layernorm", Vd)]
    return t


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    layer_types = ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(L)]
    mlp_types = ["dense" if i < d["dense_layers"] else "sparse" for i in range(L)]
    H, K = d["kda_heads"], d["kda_dim"]
    t = _vision(d, D)
    lm = "model.language_model"
    t.append(tensor(f"{lm}.embed_tokens.weight", (V, D), normal()))
    for i in range(L):
        p = f"{lm}.layers.{i}"
        t += _hyper_connection(f"{p}.hc_attn", d["hc"], D) + _hyper_connection(f"{p}.hc_ffn", d["hc"], D)
        t += norm(f"{p}.input_layernorm", D) + norm(f"{p}.post_attention_layernorm", D)
        if layer_types[i] == "linear_attention":
            t += kda(f"{p}.self_attn", D, H, K, d["conv"], a_log_shape=(H,), conv_dtype=F32)
        else:
            t += mla(f"{p}.self_attn", D, d["heads"], q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
                     qk_nope=d["nope"], qk_rope=0, v_dim=d["v"])
            t += dsa_indexer(f"{p}.self_attn.indexer", D, d["q_lora"], d["index_heads"], d["index_dim"])
            t += [tensor(f"{p}.self_attn.indexer.index_kpool_compress_ape", (d["kpool"], d["index_dim"]), normal()),
                  tensor(f"{p}.self_attn.indexer.index_kpool_compress_gate", (d["index_dim"], D), normal())]
        if mlp_types[i] == "dense":
            t += swiglu(f"{p}.mlp", D, d["inter"])
        else:
            t += router(f"{p}.mlp.gate", E, D)
            t += experts(f"{p}.mlp.experts", E, D, d["moe_inter"])
            t += swiglu(f"{p}.mlp.shared_experts", D, d["moe_inter"] * d["shared"])
    t += norm(f"{lm}.norm", D) + linear("lm_head", V, D)

    text_config = {
        "model_type": "glm5_next_text",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": d["moe_inter"],
        "num_hidden_layers": L,
        "layer_types": layer_types,
        "mlp_layer_types": mlp_types,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": 0,
        "v_head_dim": d["v"],
        "index_n_heads": d["index_heads"],
        "index_head_dim": d["index_dim"],
        "index_topk": d["index_topk"],
        "index_kpool": d["kpool"],
        "index_topk_freq": 1,
        "linear_attn_config": {"num_heads": H, "head_dim": K, "short_conv_kernel_size": d["conv"],
                               "gate_lower_bound": d["lower_bound"], "safe_gate": True},
        "hc_mult": d["hc"],
        "hc_eps": 1e-6,
        "hc_sinkhorn_iters": 20,
        "n_routed_experts": E,
        "n_shared_experts": d["shared"],
        "num_experts_per_tok": d["top_k"],
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "swiglu_limit": 10.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 1048576,
        "tie_word_embeddings": False,
        "pad_token_id": tok.id(tok.pad),
        "eos_token_id": [tok.id(x) for x in (tok.eos, *tok.stop)],
        "dtype": "bfloat16",
    }
    vision_config = {
        "model_type": "glm5_next_vision",
        "depth": d["vis_depth"],
        "hidden_size": d["vis_hidden"],
        "num_heads": d["vis_heads"],
        "intermediate_size": d["vis_inter"],
        "out_hidden_size": D,
        "projection_intermediate_size": d["vis_proj_inter"],
        "patch_size": d["patch"],
        "temporal_patch_size": d["temporal"],
        "spatial_merge_size": d["merge"],
        "in_channels": 3,
        "image_size": 336,
        "hidden_act": "silu",
        "attention_bias": True,
        "rms_norm_eps": 1e-5,
    }
    config = {
        "architectures": ["Glm5NextForConditionalGeneration"],
        "model_type": "glm5_next",
        "text_config": text_config,
        "vision_config": vision_config,
        "image_token_id": tok.id("<|image|>"),
        "video_token_id": tok.id("<|video|>"),
        "image_start_token_id": tok.id("<|begin_of_image|>"),
        "image_end_token_id": tok.id("<|end_of_image|>"),
        "video_start_token_id": tok.id("<|begin_of_video|>"),
        "video_end_token_id": tok.id("<|end_of_video|>"),
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    return config, t


FAMILY = CheckpointGenerator("glm5_next", build, SIZES, TOKENIZER)
