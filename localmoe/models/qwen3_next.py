"""Qwen3-Next (`qwen3_next`): Gated DeltaNet layers + gated full attention every
`full_attention_interval` layers; softmax-routed MoE with one sigmoid-gated shared expert.

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`.

Quirks, each covered by tests/models/test_qwen3_next.py:
- the decoder RMSNorms (input / post-attention / final, and attention q_norm / k_norm)
  compute `x * (1 + w)`: their weights get +1 when loaded, so the engine's plain RMSNorm
  applies them; the Gated DeltaNet output norm `linear_attn.norm` is a plain `x * w`.
- full attention: q_proj rows hold [query; gate] per head (`attn_output_gate`), RoPE on
  the first `partial_rotary_factor` (0.25) of each head.
- `mlp.gate` is the router (softmax, top-k renormalised by `norm_topk_prob`);
  `mlp.shared_expert.*` the shared expert, scaled by sigmoid(`mlp.shared_expert_gate`).

GGUF (`qwen3next`, llama.cpp's layout; tests/models/test_moe_gguf.py): llama.cpp stores the `(1 + w)` norms
with the 1 added (read as they are), `in_proj_qkvz` as `attn_qkv` (every head's q, then k, then v) and
`attn_gate` (z), joined back into Qwen's per-key-head order by `gguf_finish`; `ssm_a` = -exp(A_log), the conv
squeezed to [C, W], `ssm_dt.bias` = dt_bias; the MTP block is not read.
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers import gated_deltanet
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.gguf_experts import (
    GGUFKeys,
    dequantize_attention,
    gguf_moe_tensors,
    gguf_stacked_experts,
    unstack_experts,
)
from localmoe.models.moe_config import dims, require


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    interval = config.get("full_attention_interval", 4)
    types = config.get("layer_types") or ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                                          for i in range(layers)]
    dense = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step", 1)
    rope = config.get("rope_parameters") or {}
    return ModelSpec(
        model_type="qwen3_next", family="qwen3_next", **dims(config),
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        partial_rotary_factor=float(config.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0))),
        attn_output_gate=True, qk_norm=True,
        max_position_embeddings=config.get("max_position_embeddings", 262144),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        layer_kinds=tuple("attention" if t == "full_attention" else "gated_delta" for t in types),
        mlp_kinds=tuple("dense" if i in dense or (i + 1) % step else "moe" for i in range(layers)),
        num_experts=require(config, "num_experts"),
        num_experts_per_tok=require(config, "num_experts_per_tok"),
        moe_intermediate_size=require(config, "moe_intermediate_size"),
        num_shared_experts=1 if config.get("shared_expert_intermediate_size") else 0,
        shared_expert_intermediate_size=config.get("shared_expert_intermediate_size") or 0,
        norm_topk_prob=bool(config.get("norm_topk_prob", True)),
        gated_delta=gated_deltanet.Config.from_hf(config),
    )


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `qwen3next.*` metadata was converted from."""
    key = GGUFKeys(metadata, "qwen3next")
    layers, heads = key("block_count") - key("nextn_predict_layers", 0), key("attention.head_count")
    head_dim = key("attention.key_length", key("embedding_length") // heads)
    recurrent = key("attention.recurrent_layers", required=False)
    v_heads = key("ssm.time_step_rank")
    config = {
        "model_type": "qwen3_next", "num_hidden_layers": layers, "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", heads), "head_dim": head_dim,
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 1e7),
        "partial_rotary_factor": key("rope.dimension_count", head_dim) / head_dim,
        "max_position_embeddings": key("context_length", 262144), "vocab_size": key.vocab_size(),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "full_attention_interval": key("full_attention_interval", 4),
        **({"layer_types": ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]}
           if recurrent else {}),
        "mlp_only_layers": [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names],
        "num_experts": key("expert_count"), "num_experts_per_tok": key("expert_used_count"),
        "moe_intermediate_size": key("expert_feed_forward_length"),
        "shared_expert_intermediate_size": key("expert_shared_feed_forward_length", 0),
        "norm_topk_prob": bool(key("expert_weights_norm", True)),
        "linear_num_key_heads": key("ssm.group_count"), "linear_num_value_heads": v_heads,
        "linear_key_head_dim": key("ssm.state_size"), "linear_value_head_dim": key("ssm.inner_size") // v_heads,
        "linear_conv_kernel_dim": key("ssm.conv_kernel", 4),
    }
    return spec_from_hf(config)


def _conv_from_gguf(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return t.reshape(t.shape[0], 1, t.shape[-1])  # llama.cpp squeezes [C, 1, W] to [C, W]


def _a_log_from_gguf(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return torch.log(-t)  # llama.cpp stores -exp(A_log)


_GGUF_LAYER = {
    "attn_norm.weight": ("input_layernorm.weight", None), "post_attention_norm.weight":
        ("post_attention_layernorm.weight", None),  # llama.cpp added the 1 already
    **{f"attn_{'output' if p == 'o' else p}.weight": (f"self_attn.{p}_proj.weight", None) for p in "qkvo"},
    "attn_q_norm.weight": ("self_attn.q_norm.weight", None), "attn_k_norm.weight": ("self_attn.k_norm.weight", None),
    "attn_qkv.weight": ("linear_attn.qkv.weight", None), "attn_gate.weight": ("linear_attn.z.weight", None),
    "ssm_ba.weight": ("linear_attn.in_proj_ba.weight", None), "ssm_conv1d.weight": ("linear_attn.conv1d.weight",
                                                                                   _conv_from_gguf),
    "ssm_a": ("linear_attn.A_log", _a_log_from_gguf), "ssm_dt.bias": ("linear_attn.dt_bias", None),
    "ssm_norm.weight": ("linear_attn.norm.weight", None), "ssm_out.weight": ("linear_attn.out_proj.weight", None),
    "ffn_gate_inp.weight": ("mlp.router.weight", None),
    "ffn_gate_inp_shexp.weight": ("mlp.shared_expert_gate.weight", None),
    **{f"ffn_{m}_shexp.weight": (f"mlp.shared_experts.{m}_proj.weight", None) for m in ("gate", "up", "down")},
    **{f"ffn_{m}.weight": (f"mlp.{m}_proj.weight", None) for m in ("gate", "up", "down")},
}


def gguf_tensors(architecture: str) -> TensorMap:
    return gguf_moe_tensors(_GGUF_LAYER, ignore=(r"\.nextn\.",))


def gguf_finish(weights: dict, spec: ModelSpec) -> dict:
    """in_proj_qkvz in Qwen's per-key-head order [q_h, k_h, v_h, z_h] from llama.cpp's attn_qkv (all q, all k,
    all v) and attn_gate (z); the MTP block dropped; linear-attention matrices kept in blocks dequantised;
    routed experts split per expert."""
    for name in [n for n in weights if n.startswith("layers.") and int(n.split(".")[1]) >= spec.num_layers]:
        del weights[name]
    dequantize_attention(weights, (".linear_attn.",))
    c = spec.gated_delta
    Hk, K, GV = c.num_key_heads, c.key_head_dim, c.num_value_heads // c.num_key_heads * c.value_head_dim
    for i in range(spec.num_layers):
        a = f"layers.{i}.linear_attn."
        if a + "qkv.weight" in weights and a + "z.weight" in weights:
            qkv, z = weights.pop(a + "qkv.weight").float(), weights.pop(a + "z.weight").float()
            D = qkv.shape[-1]
            q, k, v = qkv.split([Hk * K, Hk * K, Hk * GV])
            parts = [q.reshape(Hk, K, D), k.reshape(Hk, K, D), v.reshape(Hk, GV, D), z.reshape(Hk, GV, D)]
            weights[a + "in_proj_qkvz.weight"] = torch.cat(parts, dim=1).reshape(-1, D)
    return unstack_experts(weights, spec)


def plus_one(tensor: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """A `(1 + w)` RMSNorm weight as the plain `w` the engine applies."""
    return tensor + 1


_GDN = ("in_proj_qkvz.weight", "in_proj_ba.weight", "conv1d.weight", "A_log", "dt_bias", "norm.weight",
        "out_proj.weight")
_L = "model.layers.{i}."

HF_TENSORS = TensorMap(
    rules=(
        TensorRule("model.embed_tokens.weight", "embed_tokens.weight"),
        TensorRule("model.norm.weight", "norm.weight", plus_one),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(_L + n, "layers.{i}." + n, plus_one)
          for n in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
                    "self_attn.k_norm.weight")),
        *(TensorRule(_L + f"self_attn.{m}.weight", f"layers.{{i}}.self_attn.{m}.weight")
          for m in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *(TensorRule(_L + f"linear_attn.{n}", f"layers.{{i}}.linear_attn.{n}") for n in _GDN),
        TensorRule(_L + "mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        *(TensorRule(_L + f"mlp.experts.{{e}}.{m}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{m}.weight")
          for m in ("gate", "up", "down")),
        *(TensorRule(_L + f"mlp.shared_expert.{m}_proj.weight", f"layers.{{i}}.mlp.shared_experts.{m}_proj.weight")
          for m in ("gate", "up", "down")),
        TensorRule(_L + "mlp.shared_expert_gate.weight", "layers.{i}.mlp.shared_expert_gate.weight"),
        *(TensorRule(_L + f"mlp.{m}_proj.weight", f"layers.{{i}}.mlp.{m}_proj.weight") for m in ("gate", "up", "down")),
    ),
    ignore=(r"rotary_emb\.inv_freq$", r"^mtp\."),  # multi-token-prediction head: not used for decoding
)


_EXPERT = "model.layers.{i}.mlp.experts.{e}"

FAMILY = register(ModelFamily(
    name="qwen3_next", model_types=("qwen3_next",), spec_from_hf=spec_from_hf, hf_tensors=HF_TENSORS,
    experts=ExpertTensors("bf16", {p: f"{_EXPERT}.{p}_proj.weight" for p in ("gate", "up", "down")}),
    gguf_architectures=("qwen3next",), spec_from_gguf=spec_from_gguf, gguf_tensors=gguf_tensors,
    gguf_finish=gguf_finish, gguf_experts=gguf_stacked_experts()))
