"""gpt-oss (`gpt_oss`): GQA with alternating sliding-window / full layers and sinks; MXFP4 MoE.

Checkpoint facts: experts stacked per layer as MXFP4 `mlp.experts.gate_up_proj_blocks`
[E, 2I, D/32, 16] / `_scales` [E, 2I, D/32] / `_bias` [E, 2I] with gate and up rows
interleaved (gate = even rows), and `down_proj_*` likewise.

Quirks, each covered by tests/models/test_gpt_oss.py:
- gate/up rows (and their bias) are de-interleaved on load into [gate rows; up rows], the
  layout every family's `gate_up_proj` uses; MXFP4 stays bytes (canonical packed layout).
- router: top-k on biased logits, softmax over the chosen; experts: clamped SwiGLU with
  biases, (up + 1) * gate * sigmoid(1.702 gate), limit 7.
- attention: q/k/v/o biases, per-head sinks, sliding-window layers, YaRN with truncate=False.

GGUF (`gpt-oss`, llama.cpp's layout): gate, up and down experts are separate tensors of ggml
`block_mxfp4` [E, rows, K/32 * 17] with F32 biases; they become the canonical stacked MXFP4
(`gguf_finish`: nibbles moved, same codes and scale bytes). Layers alternate sliding / full
from layer 0 (llama.cpp's gpt-oss pattern) and YaRN keeps gpt-oss's truncate=False (llama.cpp
rounds the correction range to whole dimensions; see docs/paging.md on gguf_parity).
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule, gguf_float
from localmoe.models.moe_config import dims, require
from localmoe.quant.mxfp4 import GGML_BLOCK_BYTES, ggml_to_canonical


def _rope(config: dict) -> tuple[float, dict | None]:
    # transformers 5 writes `rope_parameters` (with rope_theta inside); OpenAI's config `rope_scaling`
    params = dict(config.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", config.get("rope_theta", 150000.0)))
    return theta, config.get("rope_scaling") or params or None


def spec_from_hf(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    types = config.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(layers)]
    theta, scaling = _rope(config)
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"gpt_oss: hidden_act {config['hidden_act']!r} is not supported (silu only)")
    return ModelSpec(
        model_type="gpt_oss", family="gpt_oss", **dims(config),
        rms_norm_eps=config.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=config.get("max_position_embeddings", 131072),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", True)),
        layer_kinds=tuple("sliding_attention" if t == "sliding_attention" else "attention" for t in types),
        mlp_kinds=("moe",) * layers,
        num_experts=require(config, "num_local_experts"),
        num_experts_per_tok=config.get("num_experts_per_tok") or config.get("experts_per_token"),
        moe_intermediate_size=require(config, "intermediate_size"),
        scoring_func="topk_softmax", expert_act="gpt_oss_swiglu",
        sliding_window=int(config.get("sliding_window") or 128),
        swiglu_limit=float(config.get("swiglu_limit", 7.0)),
        swiglu_alpha=float(config.get("swiglu_alpha", 1.702)),
    )


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The same spec as from the HF config the GGUF was converted from (`gpt-oss.*` keys)."""
    from localmoe.errors import CheckpointError

    def key(name: str, default=None):
        value = metadata.get(f"gpt-oss.{name}", default)
        if value is None:
            raise CheckpointError(f"GGUF metadata lacks gpt-oss.{name}")
        return gguf_float(value) if isinstance(value, float) else value

    scaling = None
    if metadata.get("gpt-oss.rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": metadata["gpt-oss.rope.scaling.type"], "factor": key("rope.scaling.factor"),
                   "original_max_position_embeddings": key("rope.scaling.original_context_length"),
                   "beta_fast": key("rope.scaling.yarn_beta_fast", 32.0),
                   "beta_slow": key("rope.scaling.yarn_beta_slow", 1.0), "truncate": False}
    config = {
        "num_hidden_layers": key("block_count"), "hidden_size": key("embedding_length"),
        "intermediate_size": key("expert_feed_forward_length", metadata.get("gpt-oss.feed_forward_length")),
        "num_attention_heads": key("attention.head_count"), "num_key_value_heads": key("attention.head_count_kv"),
        "head_dim": key("attention.key_length"), "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_theta": key("rope.freq_base"), "rope_scaling": scaling,
        "vocab_size": metadata.get("gpt-oss.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ())),
        "max_position_embeddings": key("context_length"), "num_local_experts": key("expert_count"),
        "num_experts_per_tok": key("expert_used_count"), "sliding_window": key("attention.sliding_window"),
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return spec_from_hf(config)


def _deinterleave(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[E, 2I, ...] rows gate0, up0, gate1, ... -> [gate rows; up rows]."""
    return t.unflatten(1, (t.shape[1] // 2, 2)).transpose(1, 2).reshape(t.shape).contiguous()


def _blocks(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """gpt-oss `*_blocks` [E, R, K/32, 16] -> canonical packed [E, R, K/2] (same nibble order)."""
    return t.reshape(*t.shape[:2], -1)


def _gate_up_blocks(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    return _deinterleave(_blocks(t, spec), spec)


_LAYER = [("input_layernorm.weight", None), ("post_attention_layernorm.weight", None),
          *((f"self_attn.{n}_proj.{k}", None) for n in "qkvo" for k in ("weight", "bias")),
          ("self_attn.sinks", None), ("mlp.router.weight", None), ("mlp.router.bias", None)]
_EXPERTS = [("gate_up_proj_blocks", "gate_up_proj.packed", _gate_up_blocks),
            ("gate_up_proj_scales", "gate_up_proj.scales", _deinterleave),
            ("gate_up_proj_bias", "gate_up_proj.bias", _deinterleave),
            ("down_proj_blocks", "down_proj.packed", _blocks),
            ("down_proj_scales", "down_proj.scales", None),
            ("down_proj_bias", "down_proj.bias", None)]

HF_TENSORS = TensorMap(
    rules=(
        TensorRule("model.embed_tokens.weight", "embed_tokens.weight"),
        TensorRule("model.norm.weight", "norm.weight"),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(f"model.layers.{{i}}.{part}", f"layers.{{i}}.{part}", fix) for part, fix in _LAYER),
        *(TensorRule(f"model.layers.{{i}}.mlp.experts.{src}", f"layers.{{i}}.mlp.experts.{dst}", fix)
          for src, dst, fix in _EXPERTS),
    ),
    ignore=(r"rotary_emb\.inv_freq$",),
)


# GGUF name in a layer -> canonical name (testing/gpt_oss_gguf.py's writer inverts it)
GGUF_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp.weight": "mlp.router.weight",
    "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"attn_{'output' if p == 'o' else p}.{k}": f"self_attn.{p}_proj.{k}" for p in "qkvo" for k in ("weight", "bias")},
    # experts: ggml MXFP4 bytes and F32 biases per projection, joined by gguf_finish
    **{f"ffn_{p}_exps.{k}": f"mlp.experts.{p}_proj.{'ggml' if k == 'weight' else 'bias'}"
       for p in ("gate", "up", "down") for k in ("weight", "bias")},
}


def gguf_tensors(architecture: str) -> TensorMap:
    return TensorMap(rules=(
        TensorRule("token_embd.weight", "embed_tokens.weight"),
        TensorRule("output_norm.weight", "norm.weight"),
        TensorRule("output.weight", "lm_head.weight"),
        *(TensorRule(f"blk.{{i}}.{src}", f"layers.{{i}}.{dst}") for src, dst in GGUF_LAYER_NAMES.items()),
    ))


def _ggml_experts(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 experts [E, R, K/32 * 17] -> canonical (packed [E, R, K/2], scales [E, R, K/32])."""
    return ggml_to_canonical(raw.reshape(*raw.shape[:2], -1, GGML_BLOCK_BYTES))


def gguf_finish(weights: dict, spec: ModelSpec) -> dict:
    """Each layer's ggml MXFP4 gate / up / down experts -> canonical stacked `gate_up_proj` ([gate rows;
    up rows]) and `down_proj` packed + scales; biases likewise. A missing part leaves its canonical
    tensors missing, for the shape checks to name."""
    for i in range(spec.num_layers):
        e = f"layers.{i}.mlp.experts."
        if e + "down_proj.ggml" in weights:
            weights[e + "down_proj.packed"], weights[e + "down_proj.scales"] = _ggml_experts(
                weights.pop(e + "down_proj.ggml"))
        parts = [e + name for name in ("gate_proj.ggml", "up_proj.ggml", "gate_proj.bias", "up_proj.bias")]
        if all(p in weights for p in parts):
            gate_raw, up_raw, gate_bias, up_bias = (weights.pop(p) for p in parts)
            gate, up = _ggml_experts(gate_raw), _ggml_experts(up_raw)
            weights[e + "gate_up_proj.packed"] = torch.cat([gate[0], up[0]], dim=1)
            weights[e + "gate_up_proj.scales"] = torch.cat([gate[1], up[1]], dim=1)
            weights[e + "gate_up_proj.bias"] = torch.cat([gate_bias, up_bias], dim=1)
    return weights


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    D, hd, E, I = spec.hidden_size, spec.head_dim, spec.num_experts, spec.moe_intermediate_size
    q, kv = spec.num_heads * hd, spec.num_kv_heads * hd
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    for i in range(spec.num_layers):
        p = f"layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        shapes |= {
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,),
            a + "q_proj.weight": (q, D), a + "k_proj.weight": (kv, D), a + "v_proj.weight": (kv, D),
            a + "o_proj.weight": (D, q), a + "q_proj.bias": (q,), a + "k_proj.bias": (kv,),
            a + "v_proj.bias": (kv,), a + "o_proj.bias": (D,), a + "sinks": (spec.num_heads,),
            m + "router.weight": (E, D), m + "router.bias": (E,),
            m + "experts.gate_up_proj.packed": (E, 2 * I, D // 2), m + "experts.gate_up_proj.scales": (E, 2 * I, D // 32),
            m + "experts.gate_up_proj.bias": (E, 2 * I),
            m + "experts.down_proj.packed": (E, D, I // 2), m + "experts.down_proj.scales": (E, D, I // 32),
            m + "experts.down_proj.bias": (E, D),
        }
    return shapes


FAMILY = register(ModelFamily(
    name="gpt_oss",
    model_types=("gpt_oss",),
    gguf_architectures=("gpt-oss",),
    spec_from_hf=spec_from_hf,
    spec_from_gguf=spec_from_gguf,
    gguf_tensors=gguf_tensors,
    gguf_finish=gguf_finish,
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
    experts=ExpertTensors("gpt_oss_mxfp4", {"gate_up": "model.layers.{i}.mlp.experts.gate_up_proj",
                                            "down": "model.layers.{i}.mlp.experts.down_proj"}, stacked=True),
    gguf_experts=ExpertTensors("ggml_mxfp4", {p: f"blk.{{i}}.ffn_{p}_exps" for p in ("gate", "up", "down")},
                               stacked=True),
))
