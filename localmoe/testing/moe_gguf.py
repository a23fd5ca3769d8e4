"""A generated MoE checkpoint written as the GGUF llama.cpp makes of it, and its dequantised twin.

`write_moe_gguf(src, dst, types)` writes the HF checkpoint `src` (`localmoe.testing`) in llama.cpp's
layout for the family (`ARCHS`: the architecture name, metadata keys and tensor names of
convert_hf_to_gguf.py; experts stacked as `blk.N.ffn_{gate,up,down}_exps.weight` [E, rows, cols]),
each tensor in the ggml type `types` gives it (Kimi K3: testing/k3_gguf.py, its experts always MXFP4):
- "f32" / "bf16": the checkpoint's values (bf16: its bits), norms and the router F32 as llama.cpp keeps them;
- "q8_0", "q4_0", "iq4_xs", ...: every matrix in that type;
- "q4_k_m": llama-quantize's Q4_K_M mix (`moe_gguf_parts._q4_k_m`): Q4_K, with attn_v and ffn_down (experts
  too) in Q6_K on the layers `use_more_bits` picks, output Q6_K, attn_k / attn_v Q8_0 and attn_output Q5_K with
  8 experts; rows too narrow for 256-value blocks fall back as llama-quantize does (Q4_K -> Q5_0, Q6_K -> Q8_0);
- "iq_dynamic": a community "dynamic" quant: routed experts in IQ1_S ... IQ3_S, Q2_K, Q3_K by layer and
  projection (`moe_gguf_parts.IQ_DYNAMIC`), everything else as "q4_k_m";
- "mxfp4_moe": llama-quantize's MXFP4_MOE: routed experts MXFP4, everything else Q8_0.
Types the `gguf` package quantises (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16) hold the checkpoint's values
quantised; the others (the K-quants and IQ types) hold random blocks of the weights' magnitude (`ggml_blocks`).
The GGUF is then the ground truth: `write_dequantized(src, gguf, dst)` writes the HF checkpoint again
with every tensor replaced by the GGUF's values as `gguf.quants.dequantize` (an independent reader)
decodes them, in F32: the reference a GGUF loader must match.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from localmoe.testing.gpt_oss_gguf import add_tokenizer
from localmoe.testing.moe_gguf_parts import (
    PROJ,
    _a_join,
    _a_split,
    _conv_join,
    _conv_split,
    _kimi_linear_metadata,
    _kv_b_join,
    _kv_b_split,
    add_encoded,
    finish_gguf,
    ggml_type_for,
)


@dataclass(frozen=True)
class Arch:
    """One family's GGUF layout: architecture name, metadata writer, per-layer tensor names."""

    name: str
    metadata: Callable  # (writer, config) -> None
    layer: dict[str, str]  # HF name under `model.layers.{i}.` -> GGUF name under `blk.{i}.` (those present)
    experts: str  # HF name of expert e's projection P under `model.layers.{i}.`, with {e} and {p}
    top: dict[str, str]  # HF name -> GGUF name outside the layers
    # HF layer tensor -> (GGUF names, split(values, config) -> their values, join(values, config) -> HF values)
    split: dict = None
    proj: dict = None  # GGUF short name -> the HF expert projection name (default PROJ)
    top_fix: dict = None  # HF name outside the layers -> (to GGUF values, back to HF values)
    prefix: str = "model."  # what `model.` stands for in the checkpoint's names (glm5_next: `model.language_model.`)

    def hf(self, name: str) -> str:
        """An HF name written with `model.` as it is in the checkpoint."""
        return self.prefix + name.removeprefix("model.") if name.startswith("model.") else name


def _deepseek2_metadata(w, c: dict) -> None:
    _deepseek_metadata(w, c, "deepseek2")


def _deepseek32_metadata(w, c: dict) -> None:
    _deepseek_metadata(w, c, "deepseek32")
    w.add_uint32("deepseek32.attention.indexer.head_count", c["index_n_heads"])
    w.add_uint32("deepseek32.attention.indexer.key_length", c["index_head_dim"])
    w.add_uint32("deepseek32.attention.indexer.top_k", c["index_topk"])


def _glm_dsa_metadata(w, c: dict) -> None:
    """llama.cpp's GlmMoeDsaModel: deepseek32's keys under `glm-dsa`, plus the per-layer indexer types."""
    from localmoe.models.moe_config import indexer_types

    _deepseek_metadata(w, c, "glm-dsa")
    w.add_uint32("glm-dsa.attention.indexer.head_count", c["index_n_heads"])
    w.add_uint32("glm-dsa.attention.indexer.key_length", c["index_head_dim"])
    w.add_uint32("glm-dsa.attention.indexer.top_k", c["index_topk"])
    w.add_array("glm-dsa.attention.indexer.types", [t == "full" for t in indexer_types(c, c["num_hidden_layers"])])


def _deepseek_metadata(w, c: dict, arch: str) -> None:
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    nextn = c.get("num_nextn_predict_layers", 0)  # appended MTP layers count in block_count, as for glm4moe
    w.add_block_count(c["num_hidden_layers"] + nextn)
    w.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(1)  # MLA written as MQA
    w.add_rope_freq_base(float(c["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_uint32(f"{arch}.expert_gating_func", 2 if c["scoring_func"] == "sigmoid" else 1)
    w.add_uint32(f"{arch}.leading_dense_block_count", c["first_k_dense_replace"])
    w.add_uint32(f"{arch}.vocab_size", c["vocab_size"])
    w.add_uint32(f"{arch}.attention.q_lora_rank", c["q_lora_rank"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", c["kv_lora_rank"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_uint32(f"{arch}.attention.key_length_mla", c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length_mla", c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_uint32(f"{arch}.expert_shared_count", c["n_shared_experts"])
    w.add_float32(f"{arch}.expert_weights_scale", c["routed_scaling_factor"])
    if c["norm_topk_prob"]:
        w.add_bool(f"{arch}.expert_weights_norm", True)
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    rs = c.get("rope_scaling")
    if rs is None:  # GLM-5: plain RoPE
        return
    w.add_rope_scaling_type(gguf_rope_type(rs))
    w.add_rope_scaling_factor(rs["factor"])
    w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(float(rs["beta_fast"]))
    w.add_rope_scaling_yarn_beta_slow(float(rs["beta_slow"]))
    w.add_float32(f"{arch}.rope.scaling.yarn_log_multiplier", 0.1 * rs["mscale_all_dim"])


def gguf_rope_type(rope_scaling: dict):
    import gguf

    return gguf.RopeScalingType.YARN if rope_scaling.get("type", rope_scaling.get("rope_type")) == "yarn" else \
        gguf.RopeScalingType.LINEAR


def _gqa_moe_metadata(w, c: dict, experts: int, blocks: int | None = None) -> None:
    """What llama.cpp's converter writes for a GQA MoE text model: dimensions, heads, RoPE base, norms, experts."""
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(blocks or c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_rope_freq_base(float(c["rope_theta"]))
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_key_length(c["head_dim"])
    w.add_value_length(c["head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])


def _qwen3moe_metadata(w, c: dict) -> None:
    _gqa_moe_metadata(w, c, c["num_experts"])


def _glm4moe_metadata(w, c: dict) -> None:
    """llama.cpp's Glm4MoeModel: block_count counts the appended MTP layers, the rotary part in dims."""
    nextn = c.get("num_nextn_predict_layers", 0)
    _gqa_moe_metadata(w, c, c["n_routed_experts"], c["num_hidden_layers"] + nextn)
    w.add_rope_dimension_count(int(c["head_dim"] * c.get("partial_rotary_factor", 0.5)))
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_leading_dense_block_count(c["first_k_dense_replace"])
    w.add_uint32("glm4moe.expert_gating_func", 2)
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    w.add_uint32("glm4moe.nextn_predict_layers", nextn)


_TOP = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}

# an MTP layer's own tensors (llama.cpp's `blk.{L}.nextn.*`; DeepSeek's layer carries copies of the embedding and head)
_NEXTN = {f"{h}.weight": f"nextn.{g}.weight" for h, g in (
    ("eh_proj", "eh_proj"), ("enorm", "enorm"), ("hnorm", "hnorm"), ("shared_head.norm", "shared_head_norm"),
    ("shared_head.head", "shared_head_head"), ("embed_tokens", "embed_tokens"))}

_DEEPSEEK_LAYER = {  # HF -> GGUF under a layer (llama.cpp's tensor_mapping for deepseek2 / deepseek32)
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        **{f"self_attn.{h}.weight": f"{g}.weight" for h, g in (
            ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"), ("q_b_proj", "attn_q_b"),
            ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"), ("o_proj", "attn_output"),
            ("indexer.wq_b", "indexer.attn_q_b"), ("indexer.wk", "indexer.attn_k"),
            ("indexer.k_norm", "indexer.k_norm"), ("indexer.weights_proj", "indexer.proj"))},
        "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
        "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
        **{f"mlp.shared_experts.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()},
        **{f"mlp.{p}.weight": f"ffn_{s}.weight" for s, p in PROJ.items()}, **_NEXTN}
_DEEPSEEK_SPLIT = {"self_attn.kv_b_proj.weight": (("attn_k_b.weight", "attn_v_b.weight"), _kv_b_split, _kv_b_join)}

def _qwen3next_metadata(w, c: dict) -> None:
    arch = "qwen3next"
    _qwen3moe_metadata(w, c)
    w.add_uint32(f"{arch}.expert_shared_feed_forward_length", c["shared_expert_intermediate_size"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", c["linear_conv_kernel_dim"])
    w.add_uint32(f"{arch}.ssm.state_size", c["linear_key_head_dim"])
    w.add_uint32(f"{arch}.ssm.group_count", c["linear_num_key_heads"])
    w.add_uint32(f"{arch}.ssm.time_step_rank", c["linear_num_value_heads"])
    w.add_uint32(f"{arch}.ssm.inner_size", c["linear_value_head_dim"] * c["linear_num_value_heads"])
    w.add_uint32(f"{arch}.full_attention_interval", c.get("full_attention_interval", 4))
    w.add_rope_dimension_count(int(c["head_dim"] * c["partial_rotary_factor"]))


def _qkvz_split(v: np.ndarray, c: dict) -> list[np.ndarray]:
    """Qwen's per-key-head [q_h, k_h, v_h, z_h] rows -> llama.cpp's attn_qkv (all q, all k, all v) and attn_gate."""
    Hk, K = c["linear_num_key_heads"], c["linear_key_head_dim"]
    GV = c["linear_num_value_heads"] // Hk * c["linear_value_head_dim"]
    heads = v.reshape(Hk, 2 * K + 2 * GV, -1)
    q, k, vv, z = (heads[:, a:b].reshape(-1, v.shape[-1]) for a, b in
                   ((0, K), (K, 2 * K), (2 * K, 2 * K + GV), (2 * K + GV, 2 * K + 2 * GV)))
    return [np.concatenate([q, k, vv]), np.ascontiguousarray(z)]


def _qkvz_join(parts: list[np.ndarray], c: dict) -> np.ndarray:
    qkv, z = parts
    Hk, K = c["linear_num_key_heads"], c["linear_key_head_dim"]
    GV = c["linear_num_value_heads"] // Hk * c["linear_value_head_dim"]
    D = qkv.shape[-1]
    q, k, v = np.split(qkv, [Hk * K, 2 * Hk * K])
    return np.concatenate([q.reshape(Hk, K, D), k.reshape(Hk, K, D), v.reshape(Hk, GV, D), z.reshape(Hk, GV, D)],
                          axis=1).reshape(-1, D)


def _plus_one(v: np.ndarray, c: dict) -> list[np.ndarray]:
    return [v + np.float32(1)]  # llama.cpp stores Qwen3-Next's (1 + w) norms with the 1 added


def _minus_one(parts: list[np.ndarray], c: dict) -> np.ndarray:
    return parts[0] - np.float32(1)


_GLM4MOE_LAYER = {  # HF -> GGUF under a layer (llama.cpp's tensor_mapping for glm4moe)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    **{f"self_attn.{h}_proj.{x}": f"attn_{g}.{x}" for h, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
       for x in ("weight", "bias")},
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.shared_experts.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()},
    **{f"mlp.{p}.weight": f"ffn_{s}.weight" for s, p in PROJ.items()},
    **_NEXTN}

_QWEN3NEXT_LAYER = {
    **{f"self_attn.{h}.weight": f"{g}.weight" for h, g in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"))},
    **{f"linear_attn.{h}.weight": f"{g}.weight" for h, g in (
        ("in_proj_ba", "ssm_ba"), ("norm", "ssm_norm"), ("out_proj", "ssm_out"))},
    "linear_attn.dt_bias": "ssm_dt.bias", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    **{f"mlp.shared_expert.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()}}
_QWEN3NEXT_SPLIT = {
    "linear_attn.in_proj_qkvz.weight": (("attn_qkv.weight", "attn_gate.weight"), _qkvz_split, _qkvz_join),
    "linear_attn.conv1d.weight": (("ssm_conv1d.weight",), lambda v, c: [v.reshape(v.shape[0], v.shape[-1])],
                                  lambda p, c: p[0].reshape(p[0].shape[0], 1, p[0].shape[-1])),
    "linear_attn.A_log": (("ssm_a",), _a_split, _a_join),
    **{h: ((g,), _plus_one, _minus_one) for h, g in (
        ("input_layernorm.weight", "attn_norm.weight"), ("post_attention_layernorm.weight", "post_attention_norm.weight"),
        ("self_attn.q_norm.weight", "attn_q_norm.weight"), ("self_attn.k_norm.weight", "attn_k_norm.weight"))}}

_KIMI_LINEAR_LAYER = {  # HF -> GGUF under a layer (llama.cpp's tensor_mapping for kimi-linear)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{h}.weight": f"{g}.weight" for h, g in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
        ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"), ("b_proj", "ssm_beta"), ("g_a_proj", "ssm_g_a"),
        ("g_b_proj", "ssm_g_b"), ("o_norm", "ssm_norm"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"),
        ("kv_a_layernorm", "attn_kv_a_norm"))},
    "self_attn.dt_bias": "ssm_dt.bias",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"block_sparse_moe.shared_experts.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()},
    **{f"mlp.{p}.weight": f"ffn_{s}.weight" for s, p in PROJ.items()}}
_KIMI_LINEAR_SPLIT = {**_DEEPSEEK_SPLIT, "self_attn.A_log": (("ssm_a",), _a_split, _a_join),
                      **{f"self_attn.{x}_conv1d.weight": ((f"ssm_conv1d_{x}.weight",), _conv_split, _conv_join)
                         for x in "qkv"}}

def _glm5_next_metadata(w, c: dict) -> None:
    """llama.cpp's Glm5NextModel (conversion/glm.py): KDA where head_count_kv[i] is 0, MLA (NoPE) + DSA k-pool
    indexer elsewhere, mHC, DeepSeek-style MoE; a few keys derived from the released config's fields."""
    from localmoe.models.moe_config import indexer_types

    arch, L, lin = w.arch, c["num_hidden_layers"], c["linear_attn_config"]
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(L)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([0 if t == "linear_attention" else 1 for t in c["layer_types"]])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["n_routed_experts"])
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_group_count(c["n_group"])
    w.add_expert_group_used_count(c["topk_group"])
    w.add_vocab_size(c["vocab_size"])
    w.add_layer_norm_eps(1e-6)
    w.add_uint32(f"{arch}.ssm.conv_kernel", lin["short_conv_kernel_size"])
    w.add_uint32(f"{arch}.kda.head_dim", lin["head_dim"])
    if lin.get("gate_lower_bound") is not None:
        w.add_float32(f"{arch}.kda.gate_lower_bound", lin["gate_lower_bound"])
    w.add_uint32(f"{arch}.attention.q_lora_rank", c["q_lora_rank"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", c["kv_lora_rank"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_uint32(f"{arch}.attention.key_length_mla", c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length_mla", c["v_head_dim"])
    for key, field in (("head_count", "index_n_heads"), ("key_length", "index_head_dim"), ("top_k", "index_topk"),
                       ("kpool", "index_kpool")):
        w.add_uint32(f"{arch}.attention.indexer.{key}", c[field])
    w.add_bool(f"{arch}.attention.indexer.kpool_select_tail", c.get("index_kpool_always_select_tail", True))
    w.add_array(f"{arch}.attention.indexer.types", [t == "full" for t in indexer_types(c, L)])
    w.add_uint32(f"{arch}.hyper_connection.count", c["hc_mult"])
    w.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", c["hc_sinkhorn_iters"])
    w.add_float32(f"{arch}.hyper_connection.epsilon", c["hc_eps"])
    dense = c.get("first_k_dense_replace", c["mlp_layer_types"].index("sparse"))
    w.add_leading_dense_block_count(dense)
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_expert_shared_count(c["n_shared_experts"])
    w.add_expert_weights_scale(c["routed_scaling_factor"])
    w.add_expert_weights_norm(c["norm_topk_prob"])
    for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp"):
        w.add_array(f"{arch}.{key}", [float(c["swiglu_limit"])] * L)


_GLM5_NEXT_LAYER = {  # HF -> GGUF under a layer (llama.cpp's tensor_mapping for glm5-next)
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"hc_{s}_{t}": f"hc_{s}_{t}.weight" for s in ("attn", "ffn") for t in ("fn", "base", "scale")},
    **{f"self_attn.{h}.weight": f"{g}.weight" for h, g in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
        ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"), ("b_proj", "ssm_beta"), ("g_a_proj", "ssm_g_a"),
        ("g_b_proj", "ssm_g_b"), ("o_norm", "ssm_norm"), ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"),
        ("q_b_proj", "attn_q_b"), ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"),
        ("indexer.wq_b", "indexer.attn_q_b"), ("indexer.wk", "indexer.attn_k"), ("indexer.k_norm", "indexer.k_norm"),
        ("indexer.weights_proj", "indexer.proj"))},
    "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias", "self_attn.dt_bias": "ssm_dt.bias",
    **{f"self_attn.indexer.index_kpool_compress_{x}": f"indexer_compressor_{x}.weight" for x in ("gate", "ape")},
    "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"mlp.shared_experts.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()},
    **{f"mlp.{p}.weight": f"ffn_{s}.weight" for s, p in PROJ.items()}}

ARCHS = {
    "qwen3_moe": Arch("qwen3moe", _qwen3moe_metadata, {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight"}, "mlp.experts.{e}.{p}.weight", _TOP),
    "deepseek_v32": Arch("deepseek32", _deepseek32_metadata, _DEEPSEEK_LAYER, "mlp.experts.{e}.{p}.weight", _TOP,
                         split=_DEEPSEEK_SPLIT),
    "glm_moe_dsa": Arch("glm-dsa", _glm_dsa_metadata, _DEEPSEEK_LAYER, "mlp.experts.{e}.{p}.weight", _TOP,
                        split=_DEEPSEEK_SPLIT),
    "deepseek_v3": Arch("deepseek2", _deepseek2_metadata, _DEEPSEEK_LAYER, "mlp.experts.{e}.{p}.weight", _TOP,
                        split=_DEEPSEEK_SPLIT),
    "kimi_linear": Arch("kimi-linear", _kimi_linear_metadata, _KIMI_LINEAR_LAYER,
                        "block_sparse_moe.experts.{e}.{p}.weight", _TOP, split=_KIMI_LINEAR_SPLIT,
                        proj={"gate": "w1", "up": "w3", "down": "w2"}),
    "glm4_moe": Arch("glm4moe", _glm4moe_metadata, _GLM4MOE_LAYER, "mlp.experts.{e}.{p}.weight", _TOP),
    "qwen3_next": Arch("qwen3next", _qwen3next_metadata, _QWEN3NEXT_LAYER, "mlp.experts.{e}.{p}.weight", _TOP,
                       split=_QWEN3NEXT_SPLIT, top_fix={"model.norm.weight": (_plus_one, _minus_one)}),
    "glm5_next": Arch("glm5-next", _glm5_next_metadata, _GLM5_NEXT_LAYER, "mlp.experts.{e}.{p}.weight", _TOP,
                      split=_KIMI_LINEAR_SPLIT, prefix="model.language_model."),
}


def _hf_tensors(ckpt, arch: Arch, config: dict) -> list[tuple[str, Callable[[], np.ndarray]]]:
    """(GGUF name, producer of float32 values) in llama.cpp's order."""
    def f32(name):
        return lambda: ckpt.tensor(name).float().numpy()

    out = [(arch.top["model.embed_tokens.weight"], f32(arch.hf("model.embed_tokens.weight")))]
    E = config.get("num_experts") or config["n_routed_experts"]
    names = set(ckpt.keys())
    for i in range(config["num_hidden_layers"] + config.get("num_nextn_predict_layers", 0)):  # MTP layers appended
        p = arch.hf(f"model.layers.{i}.")
        out += [(f"blk.{i}.{dst}", f32(p + src)) for src, dst in arch.layer.items() if p + src in names]
        for src, (dsts, split, _) in (arch.split or {}).items():
            if p + src not in names:
                continue
            for k, dst in enumerate(dsts):
                out.append((f"blk.{i}.{dst}", lambda src=p + src, k=k, split=split: split(f32(src)(), config)[k]))
        proj = arch.proj or PROJ
        if p + arch.experts.format(e=0, p=proj["gate"]) not in names:
            continue  # a dense layer
        for short, hf in proj.items():
            stack = [p + arch.experts.format(e=e, p=hf) for e in range(E)]
            out.append((f"blk.{i}.ffn_{short}_exps.weight",
                        lambda stack=stack: np.stack([ckpt.tensor(n).float().numpy() for n in stack])))
    out += [(arch.top["model.norm.weight"], f32(arch.hf("model.norm.weight"))),
            (arch.top["lm_head.weight"], f32("lm_head.weight"))]
    for hf, (fix, _) in (arch.top_fix or {}).items():
        out = [(g, (lambda make=make, fix=fix: fix(make(), config)[0]) if g == arch.top[hf] else make) for g, make in out]
    return out


def write_moe_gguf(src: Path, dst: Path, types: str = "f32", seed: int = 0, ckpt=None) -> Path:
    """Write the generated checkpoint `src` as llama.cpp's GGUF of its family, in `types` (module doc); `ckpt`: its
    tensors from elsewhere (testing.planned.PlannedCheckpoint: `src` then holds config and tokenizer only; not K3)."""
    import gguf

    from localmoe.store.safetensors import SafetensorsCheckpoint

    config = json.loads((src / "config.json").read_text())
    if config["model_type"] == "kimi_k3":
        from localmoe.testing.k3_gguf import write_k3_gguf

        return write_k3_gguf(src, dst, types, seed)
    arch = ARCHS[config["model_type"]]
    config = config.get("text_config", config)  # glm5_next: the text model's fields
    ckpt = SafetensorsCheckpoint(src) if ckpt is None else ckpt
    rng = np.random.default_rng(seed)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch.name)
    w.add_name(f"localmoe test {src.name}")
    arch.metadata(w, config)
    add_tokenizer(w, src, config["vocab_size"], chat_template=True)
    layers, E = config["num_hidden_layers"], config.get("num_experts") or config["n_routed_experts"]
    for name, make in _hf_tensors(ckpt, arch, config):
        values = make()
        qtype = ggml_type_for(name, values.shape, types, layers, E)
        add_encoded(w, name, values, qtype, rng)
    return finish_gguf(w, tmp, dst)


def write_dequantized(src: Path, gguf_path: Path, dst: Path) -> Path:
    """The HF checkpoint `src` again, every tensor replaced by the GGUF's values (F32), decoded by
    `gguf.GGUFReader` + `gguf.quants.dequantize`; config and tokenizer files copied."""
    import gguf
    import torch
    from safetensors.torch import save_file

    config = json.loads((src / "config.json").read_text())
    if config["model_type"] == "kimi_k3":
        from localmoe.testing.k3_gguf import write_k3_dequantized

        return write_k3_dequantized(src, gguf_path, dst)
    arch = ARCHS[config["model_type"]]
    config = config.get("text_config", config)
    to_hf = {v: k for k, v in arch.top.items()}
    reader = gguf.GGUFReader(gguf_path)
    tensors: dict[str, torch.Tensor] = {}
    pending: dict[tuple[str, str], dict[str, np.ndarray]] = {}  # (layer prefix, HF name) -> split parts read
    split_of = {dst: (src, dsts, join) for src, (dsts, _, join) in (arch.split or {}).items() for dst in dsts}
    for t in reader.tensors:
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(tuple(int(n) for n in reversed(t.shape)))
        if t.name in to_hf:
            fix = (arch.top_fix or {}).get(to_hf[t.name])
            tensors[arch.hf(to_hf[t.name])] = torch.from_numpy(np.ascontiguousarray(fix[1]([values], config) if fix
                                                                                   else values))
            continue
        _, i, rest = t.name.split(".", 2)
        p = arch.hf(f"model.layers.{i}.")
        if rest.endswith("_exps.weight"):
            hf = (arch.proj or PROJ)[rest.removeprefix("ffn_").removesuffix("_exps.weight")]
            for e in range(values.shape[0]):
                tensors[p + arch.experts.format(e=e, p=hf)] = torch.from_numpy(values[e].copy())
        elif rest in split_of:
            hf_name, dsts, join = split_of[rest]
            got = pending.setdefault((p, hf_name), {})
            got[rest] = values
            if len(got) == len(dsts):
                tensors[p + hf_name] = torch.from_numpy(np.ascontiguousarray(join([got[d] for d in dsts], config)))
        else:
            tensors[p + {v: k for k, v in arch.layer.items()}[rest]] = torch.from_numpy(values.copy())
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
