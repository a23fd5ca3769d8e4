"""DeepSeek-V3.2 (`deepseek_v32`, transformers `DeepseekV32ForCausalLM`): MLA with RoPE on the
shared rope part and the DSA lightning indexer in every layer, sigmoid-routed MoE with
correction bias and group-limited top-k, shared experts.

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`.

Quirks, each covered by tests/models/test_deepseek_v32.py:
- `mlp.gate.*` is the router: renamed to `mlp.router.weight` / `mlp.router.e_score_correction_bias`;
  sigmoid scores, bias for selection only, renormalised, times `routed_scaling_factor`.
- MLA's rope part uses interleaved pairs, the indexer half-split RoPE (engine/layers/mla.py, indexer.py);
  under YaRN the softmax scale is multiplied by mscale^2 (mscale_all_dim).
- `self_attn.indexer.k_norm` is a LayerNorm (weight and bias); the released FP8 weights and the
  MTP layer (`model.layers.{num_hidden_layers}`) are not read: convert to bf16 first.
"""

from __future__ import annotations

from localmoe.config import ModelSpec
from localmoe.engine.layers.indexer import indexer_shapes
from localmoe.engine.layers.mla import mla_shapes
from localmoe.engine.layers.moe import moe_shapes
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule
from localmoe.models.moe_config import dsa_fields, experts, moe_placement, moe_spec, require

_MLA = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def deepseek_spec(config: dict) -> ModelSpec:
    layers = require(config, "num_hidden_layers")
    return moe_spec(config, "deepseek_v32", ("dsa",) * layers,
                    moe_placement(layers, config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)),
                    "config.json", **dsa_fields(config, "config.json"))


def layer_rules(src: str, extra: tuple[str, ...] = ()) -> tuple[TensorRule, ...]:
    """Rules for `{src}layers.{i}.*` (MLA + indexer + DeepSeek MoE) to canonical `layers.{i}.*`; `extra`:
    more `self_attn.*` names kept as they are."""
    L = src + "layers.{i}."
    return (
        *(TensorRule(L + n, "layers.{i}." + n) for n in ("input_layernorm.weight", "post_attention_layernorm.weight")),
        *(TensorRule(L + f"self_attn.{n}", f"layers.{{i}}.self_attn.{n}") for n in _MLA + extra),
        *(TensorRule(L + f"self_attn.indexer.{n}", f"layers.{{i}}.self_attn.indexer.{n}") for n in _INDEXER),
        TensorRule(L + "mlp.gate.weight", "layers.{i}.mlp.router.weight"),
        TensorRule(L + "mlp.gate.e_score_correction_bias", "layers.{i}.mlp.router.e_score_correction_bias"),
        *(TensorRule(L + f"mlp.experts.{{e}}.{m}_proj.weight", f"layers.{{i}}.mlp.experts.{{e}}.{m}.weight")
          for m in ("gate", "up", "down")),
        *(TensorRule(L + f"mlp.{s}{m}_proj.weight", f"layers.{{i}}.mlp.{s}{m}_proj.weight")
          for s in ("", "shared_experts.") for m in ("gate", "up", "down")),
    )


HF_TENSORS = TensorMap(
    rules=(TensorRule("model.embed_tokens.weight", "embed_tokens.weight"), TensorRule("model.norm.weight", "norm.weight"),
           TensorRule("lm_head.weight", "lm_head.weight"), *layer_rules("model.")),
    ignore=(r"rotary_emb\.inv_freq$",),
)


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    D = spec.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"embed_tokens.weight": (spec.vocab_size, D), "norm.weight": (D,)}
    if not spec.tie_word_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, D)
    for i in range(spec.num_layers):
        a = f"layers.{i}.self_attn."
        shapes |= moe_shapes(spec, i) | mla_shapes(spec, a) | indexer_shapes(spec, a)
    return shapes


DEEPSEEK = register(ModelFamily(name="deepseek_v32", model_types=("deepseek_v32",),
                           spec_from_hf=deepseek_spec, hf_tensors=HF_TENSORS, expected_shapes=expected_shapes,
                           experts=experts("model.")))
