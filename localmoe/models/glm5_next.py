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
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.engine.layers import hyper_connections, kda
from localmoe.engine.transformer import model_tensors
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import dsa_fields, experts, moe_spec, require

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


def indexer_types(text: dict, layers: int) -> list[str]:
    """"full" (runs its indexer) or "shared" per layer, as transformers derives them."""
    if text.get("indexer_types"):
        return list(text["indexer_types"])
    pattern = text.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(text.get("index_topk_freq", 1), 1), text.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(layers)]


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


GLM5 = register(ModelFamily(name="glm5_next", model_types=("glm5_next",),
                       spec_from_hf=glm5_spec, hf_tensors=HF_TENSORS, expected_shapes=expected_shapes,
                       experts=experts(_P)))
