"""GLM-5-Next (`glm5_next`, transformers `Glm5NextForConditionalGeneration`): KDA linear layers with
the bounded delta gate, NoPE MLA layers with a k-pool DSA indexer, sigmoid-routed MoE, all inside
manifold hyper-connections over `hc_mult` residual streams. The text config is `text_config`, the
text tower under `model.language_model.`, `lm_head` at the top; the vision tower (`model.visual.`)
is not read.

Quirks, each covered by tests/models/test_glm5_next.py:
- hyper-connections (engine/layers/hyper_connections.py): `hc_{attn,ffn}_{fn,base,scale}` per layer; the
  output is the mean of the streams, then `norm` and `lm_head`.
- KDA (`linear_attention`): lower-bounded "safe" gate (`linear_lower_bound` / `gate_lower_bound`,
  None: Kimi-Linear's softplus gate), low-rank output gate `g_a_proj`/`g_b_proj`, `A_log` [H],
  separate q/k/v convs; sizes from `linear_attn_config` or the flat `linear_*` fields.
- DSA (`indexed_attention`): MLA with q LoRA and no rope part (`qk_rope_head_dim` 0); its norms
  use `rms_norm_eps`; the indexer scores pools of `index_kpool` tokens
  (`index_kpool_compress_{gate,ape}`, engine/layers/kpool_indexer.py). Layers that reuse another layer's
  selection (`indexer_types` "shared") are refused.
- every SwiGLU clamps at `swiglu_limit` (dense, shared and routed experts).
The MTP layer (`layers.{num_hidden_layers}`) is not read.

GGUF (`glm5-next`, llama.cpp's Glm5NextModel; tests/models/test_moe_gguf.py, benchmarks/gguf_moe_fidelity.py):
kimi-linear's KDA names, MLA without a rope part (`attn_k_b` / `attn_v_b` joined back), the indexer with its
k-pool compressor `indexer_compressor_{gate,ape}`, `hc_{attn,ffn}_{fn,base,scale}`; a layer is MLA + DSA where
`attention.head_count_kv[i]` > 0; the appended MTP blocks (`nextn_predict_layers`) dropped.
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.engine.layers import hyper_connections, kda
from localmoe.engine.transformer import model_tensors
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule, gguf_float
from localmoe.models.gguf_experts import (
    KDA_GGUF,
    MLA_GGUF,
    MOE_GGUF,
    GGUFKeys,
    gguf_moe_tensors,
    gguf_stacked_experts,
    mla_finish,
)
from localmoe.models.moe_config import dsa_fields, experts, indexer_types, moe_spec, require

SOURCE = "config.json text_config"
KINDS = {"linear_attention": "kda", "indexed_attention": "dsa", "full_attention": "dsa"}  # full == indexed (HF)


def kda_config(text: dict) -> kda.Config:
    """KDA sizes and gate from `linear_attn_config` (as released) or the flat `linear_*` fields."""
    linear = text.get("linear_attn_config") or {}
    bound = linear.get("gate_lower_bound", text.get("linear_lower_bound", -5.0))
    if bound is None and linear and linear.get("safe_gate", True):  # as transformers reads the dict
        bound = -5.0
    return kda.Config(num_heads=linear.get("num_heads", text.get("linear_num_heads", 64)),
                      head_dim=linear.get("head_dim", text.get("linear_head_dim", 128)),
                      conv_kernel=linear.get("short_conv_kernel_size", text.get("linear_conv_kernel_dim", 4)),
                      bounded_gate=bound is not None, gate_lower_bound=-5.0 if bound is None else float(bound),
                      full_rank_gate=False, norm_eps=text.get("rms_norm_eps", 1e-5), hidden_size=text["hidden_size"])


def glm5_spec(config: dict) -> ModelSpec:
    text = require(config, "text_config")
    L = require(text, "num_hidden_layers", SOURCE)
    kinds = tuple(KINDS[t] for t in text.get("layer_types") or
                  ["linear_attention" if i % 4 != 3 else "indexed_attention" for i in range(L)])
    mlp = tuple({"dense": "dense", "sparse": "moe"}[t] for t in text.get("mlp_layer_types") or
                ["dense"] * min(3, L) + ["sparse"] * (L - 3))
    shared = [i for i, t in enumerate(indexer_types(text, L)) if t == "shared" and kinds[i] == "dsa"]
    if shared:
        raise UnsupportedModelError(f"glm5_next: layers {shared} reuse another layer's DSA selection "
                                    "(indexer_types 'shared'), which is not supported")
    if text.get("qk_rope_head_dim", 0):
        raise UnsupportedModelError("glm5_next: DSA layers are NoPE (qk_rope_head_dim must be 0)")
    if text.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"glm5_next: hidden_act {text['hidden_act']!r} is not supported (silu only)")
    eps = text.get("rms_norm_eps", 1e-5)
    fields = dsa_fields(text, SOURCE)
    latent = dataclasses.replace(fields["dsa"].mla, use_nope=True, scale_factor=1.0, norm_eps=eps)
    fields["dsa"] = dataclasses.replace(fields["dsa"], mla=latent, index_kpool=int(text.get("index_kpool", 16)),
                                        index_kpool_tail=bool(text.get("index_kpool_always_select_tail", True)))
    spec = moe_spec(text, "glm5_next", kinds, mlp, SOURCE, **fields, kda=kda_config(text),
                    glu_limit=float(text.get("swiglu_limit", 10.0)))
    return dataclasses.replace(
        spec, rms_norm_eps=eps, max_position_embeddings=text.get("max_position_embeddings", 1048576),
        hyper_connections=hyper_connections.Config(int(text.get("hc_mult", 4)), L, spec.hidden_size,
                                                   float(text.get("hc_eps", 1e-6)),
                                                   int(text.get("hc_sinkhorn_iters", 20)), eps))


_P = "model.language_model."
_KDA = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight",
        "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_a_proj.weight", "g_b_proj.weight", "A_log",
        "dt_bias", "o_norm.weight", "o_proj.weight")
_MLA = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight")  # + o_proj above
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight",
            "index_kpool_compress_ape", "index_kpool_compress_gate")
_LAYER = ("input_layernorm.weight", "post_attention_layernorm.weight",
          *(f"hc_{s}_{t}" for s in ("attn", "ffn") for t in ("fn", "base", "scale")),
          *(f"self_attn.{n}" for n in _KDA + _MLA), *(f"self_attn.indexer.{n}" for n in _INDEXER),
          *(f"mlp.{s}{m}_proj.weight" for s in ("", "shared_experts.") for m in ("gate", "up", "down")))

HF_TENSORS = TensorMap(
    rules=(
        TensorRule(_P + "embed_tokens.weight", "embed_tokens.weight"),
        TensorRule(_P + "norm.weight", "norm.weight"),
        TensorRule("lm_head.weight", "lm_head.weight"),
        *(TensorRule(f"{_P}layers.{{i}}.{n}", f"layers.{{i}}.{n}") for n in _LAYER),
        TensorRule(_P + "layers.{i}.mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        TensorRule(_P + "layers.{i}.mlp.gate.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias"),
        *(TensorRule(f"{_P}layers.{{i}}.mlp.experts.{{e}}.{m}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{m}.weight")
          for m in ("gate", "up", "down")),
    ),
    ignore=(r"rotary_emb\.inv_freq$", r"^model\.visual\."),
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """The composed shapes, with KDA's `A_log` stored as [H]."""
    shapes = model_tensors(spec)
    for i in (i for i, kind in enumerate(spec.layer_kinds) if kind == "kda"):
        shapes[f"layers.{i}.self_attn.A_log"] = (spec.kda.num_heads,)
    return shapes


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF text config the `glm5-next.*` metadata was converted from (llama.cpp's Glm5NextModel):
    a layer is MLA + DSA where `attention.head_count_kv[i]` > 0, else KDA; the appended MTP blocks dropped."""
    key = GGUFKeys(metadata, "glm5-next")
    nextn = key("nextn_predict_layers", 0)
    layers = key("block_count") - nextn
    kv = key("attention.head_count_kv")
    kv = kv if isinstance(kv, list) else [kv] * layers
    dense = key("leading_dense_block_count", 0)
    heads = key("attention.head_count")
    lin = {"num_heads": heads, "head_dim": key("kda.head_dim"), "short_conv_kernel_size": key("ssm.conv_kernel", 4)}
    if (bound := key("kda.gate_lower_bound", required=False)) is not None:
        lin["gate_lower_bound"] = bound
    types = key("attention.indexer.types", required=False)
    limit = key("swiglu_clamp_exp", required=False)
    text = {
        "num_hidden_layers": layers, "layer_types": ["indexed_attention" if n else "linear_attention" for n in kv[:layers]],
        "mlp_layer_types": ["dense" if i < dense else "sparse" for i in range(layers)],
        "hidden_size": key("embedding_length"), "intermediate_size": key("feed_forward_length"),
        "moe_intermediate_size": key("expert_feed_forward_length"), "num_attention_heads": heads,
        "num_key_value_heads": heads, "q_lora_rank": key("attention.q_lora_rank"),
        "kv_lora_rank": key("attention.kv_lora_rank"), "qk_rope_head_dim": key("rope.dimension_count", 0),
        "qk_nope_head_dim": key("attention.key_length_mla") - key("rope.dimension_count", 0),
        "v_head_dim": key("attention.value_length_mla"), "index_n_heads": key("attention.indexer.head_count"),
        "index_head_dim": key("attention.indexer.key_length"), "index_topk": key("attention.indexer.top_k"),
        "index_kpool": key("attention.indexer.kpool"),
        "index_kpool_always_select_tail": bool(key("attention.indexer.kpool_select_tail", True)),
        **({"indexer_types": ["full" if t else "shared" for t in types[:layers]]} if types is not None else {}),
        "linear_attn_config": lin, "hc_mult": key("hyper_connection.count"),
        "hc_eps": key("hyper_connection.epsilon"), "hc_sinkhorn_iters": key("hyper_connection.sinkhorn_iterations"),
        "n_routed_experts": key("expert_count"), "n_shared_experts": key("expert_shared_count", 0),
        "num_experts_per_tok": key("expert_used_count"), "n_group": key("expert_group_count", 1),
        "topk_group": key("expert_group_used_count", 1), "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": key("expert_weights_scale", 1.0),
        **({"swiglu_limit": gguf_float(limit[0] if isinstance(limit, list) else limit)} if limit is not None else {}),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "max_position_embeddings": key("context_length"),
        "vocab_size": key.vocab_size(), "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    return dataclasses.replace(glm5_spec({"text_config": text}), nextn_layers=nextn)


def gguf_tensors(architecture: str) -> TensorMap:
    """llama.cpp's glm5-next names: kimi-linear's KDA and MLA (no rope part) tensors, the DSA indexer with its k-pool
    compressor (`indexer_compressor_{gate,ape}`), the hyper-connections `hc_{attn,ffn}_{fn,base,scale}`."""
    layer = {**{f"{g}.weight": (f"self_attn.{h}.weight", None) for g, h in MLA_GGUF.items()},
             **{g: (f"self_attn.{h}", fix) for g, (h, fix) in KDA_GGUF.items()},
             **{g: (h, None) for g, h in MOE_GGUF.items()},
             **{f"indexer.{g}.weight": (f"self_attn.indexer.{h}.weight", None)
                for g, h in (("attn_q_b", "wq_b"), ("attn_k", "wk"), ("k_norm", "k_norm"), ("proj", "weights_proj"))},
             "indexer.k_norm.bias": ("self_attn.indexer.k_norm.bias", None),
             **{f"indexer_compressor_{x}.weight": (f"self_attn.indexer.index_kpool_compress_{x}", None)
                for x in ("gate", "ape")},
             **{f"hc_{s}_{t}.weight": (f"hc_{s}_{t}", None) for s in ("attn", "ffn") for t in ("fn", "base", "scale")}}
    return gguf_moe_tensors(layer, ignore=(r"\.nextn\.",))


GLM5 = register(ModelFamily(name="glm5_next", model_types=("glm5_next",),
                       spec_from_hf=glm5_spec, hf_tensors=HF_TENSORS, expected_shapes=expected_shapes,
                       experts=experts(_P), gguf_architectures=("glm5-next",), spec_from_gguf=spec_from_gguf,
                       gguf_tensors=gguf_tensors, gguf_finish=mla_finish, gguf_experts=gguf_stacked_experts()))
