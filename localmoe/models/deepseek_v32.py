"""DeepSeek-V3.2 (`deepseek_v32`, transformers `DeepseekV32ForCausalLM`): MLA with RoPE on the
shared rope part and the DSA lightning indexer in every layer, sigmoid-routed MoE with
correction bias and group-limited top-k, shared experts. DeepSeek-V3 / V3.1 / R1 (`deepseek_v3`,
`DeepseekV3ForCausalLM`) is the same model without the indexer: plain MLA layers. GLM-5 / 5.1 / 5.2
(`glm_moe_dsa`, `GlmMoeDsaForCausalLM`) is V3.2 with two changes (tests/models/test_glm_moe_dsa.py):
its indexer's RoPE is over adjacent pairs (interleaved, `dsa.Config.index_rope_interleaved`), and the
layers `indexer_types` marks "shared" (also spelt `index_topk_pattern` "FSS..." or `index_topk_freq` /
`index_skip_topk_offset`) have no indexer: they reuse the previous full layer's selection (layer kind
`dsa_shared`, engine/layers/dsa_shared.py; no `self_attn.indexer.*` tensors in the checkpoint). Names,
routing, norms and the MTP layer are V3.2's; its config defaults differ (one expert group, no YaRN).

Checkpoint facts: routed experts per expert in bf16 `mlp.experts.{e}.{gate,up,down}_proj`.

Quirks, each covered by tests/models/test_deepseek_v32.py:
- `mlp.gate.*` is the router: renamed to `mlp.router.weight` / `mlp.router.e_score_correction_bias`;
  sigmoid scores, bias for selection only, renormalised, times `routed_scaling_factor`.
- MLA's rope part uses interleaved pairs, the indexer half-split RoPE (engine/layers/mla.py, indexer.py);
  under YaRN the softmax scale is multiplied by mscale^2 (mscale_all_dim).
- `self_attn.indexer.k_norm` is a LayerNorm (weight and bias); the released FP8 weights are not read:
  convert to bf16 first. The MTP layer (`model.layers.{num_hidden_layers}`, `num_nextn_predict_layers`,
  `ModelSpec.nextn_layers`) is no part of the model: loaded only for `--spec mtp` (load.load_nextn,
  engine/nextn.py; its own tensors through models/base.py NEXTN_TENSORS), kept dense by `convert`.

GGUF (`deepseek32`, and `deepseek2` for V3 without the indexer; llama.cpp's layout; tests/models/test_moe_gguf.py): llama.cpp splits `kv_b_proj`
per head into `attn_k_b` [H, kv_lora, nope] (transposed, for the absorbed decode) and `attn_v_b`
[H, v, kv_lora]; `gguf_finish` joins them back. The indexer is `indexer.{attn_q_b,attn_k,k_norm,proj}`,
the correction bias `exp_probs_b.bias`, shared experts `ffn_*_shexp`, routed experts stacked (split per
expert, models/gguf_experts.py). YaRN's `mscale_all_dim` comes back from `rope.scaling.yarn_log_multiplier`
(written as 0.1 x mscale_all_dim; `mscale` is taken equal to it, as in every DeepSeek release); the
appended MTP block (`blk.{num_hidden_layers}`, `nextn_predict_layers`) is left out of the model
(checkpoint.tensor_names) and read for `--spec mtp` (models/base.py NEXTN_GGUF; llama.cpp's converter
usually drops it for DeepSeek, so no GGUF test here).
"""

from __future__ import annotations

import dataclasses

from localmoe.config import ModelSpec
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule
from localmoe.models.gguf_experts import (
    MLA_GGUF,
    MOE_GGUF,
    GGUFKeys,
    gguf_moe_tensors,
    gguf_stacked_experts,
    mla_finish,
)
from localmoe.models.moe_config import dsa_fields, experts, indexer_types, moe_placement, moe_spec, require

_MLA = ("q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "q_proj.weight", "kv_a_proj_with_mqa.weight",
        "kv_a_layernorm.weight", "kv_b_proj.weight", "o_proj.weight")
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def deepseek_spec(config: dict) -> ModelSpec:
    """DeepSeek-V3.2 (`deepseek_v32`: MLA + the DSA indexer in every layer) or DeepSeek-V3 / V3.1 / R1
    (`deepseek_v3`: the same model without the indexer, plain MLA) or GLM-5 (`glm_moe_dsa`: full and shared
    DSA layers, interleaved indexer RoPE)."""
    layers = require(config, "num_hidden_layers")
    model_type = config.get("model_type", "deepseek_v32")
    indexer = model_type != "deepseek_v3"
    spec = moe_spec(config, model_type, ("dsa" if indexer else "mla",) * layers,
                    moe_placement(layers, config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)),
                    "config.json", nextn_layers=int(config.get("num_nextn_predict_layers") or 0),
                    **dsa_fields(config, "config.json", indexer))
    return glm_dsa(spec, config) if model_type == "glm_moe_dsa" else spec


def glm_dsa(spec: ModelSpec, config: dict) -> ModelSpec:
    """GLM-5's changes to a V3.2 spec: `dsa_shared` layers where `indexer_types` says "shared", interleaved RoPE
    in the indexer."""
    types = indexer_types(config, spec.num_layers)
    if len(types) != spec.num_layers or set(types) - {"full", "shared"} or types[0] != "full":
        raise UnsupportedModelError(f"glm_moe_dsa: config.json indexer_types {types} must give 'full' or 'shared' "
                                    f"for each of the {spec.num_layers} layers, starting with 'full'")
    return dataclasses.replace(spec, layer_kinds=tuple("dsa" if t == "full" else "dsa_shared" for t in types),
                               dsa=dataclasses.replace(spec.dsa, index_rope_interleaved=True))


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


_GATING = {1: "softmax", 2: "sigmoid"}  # llama.cpp's expert_gating_func


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `deepseek32.*` (V3.2), `glm-dsa.*` (GLM-5) or `deepseek2.*` (V3, V3.1, R1: no
    indexer) metadata was converted from."""
    arch = metadata["general.architecture"]
    key = GGUFKeys(metadata, arch)
    indexer = arch != "deepseek2"
    layers = key("block_count") - key("nextn_predict_layers", 0)
    heads, rope = key("attention.head_count"), key("rope.dimension_count")
    scaling = key.rope_scaling()
    if scaling is not None and scaling["rope_type"] == "yarn":
        scaling["type"] = scaling.pop("rope_type")  # DeepSeek's configs spell it `type`
        log_mul = key("rope.scaling.yarn_log_multiplier", required=False)
        if log_mul:
            scaling["mscale"] = scaling["mscale_all_dim"] = round(log_mul / 0.1, 6)
    gating = key("expert_gating_func", 2)
    if gating not in _GATING:
        from localmoe.errors import UnsupportedModelError

        raise UnsupportedModelError(f"GGUF {arch}.expert_gating_func {gating} is not supported (softmax 1, sigmoid 2)")
    config = {
        "model_type": {"deepseek32": "deepseek_v32", "glm-dsa": "glm_moe_dsa"}.get(arch, "deepseek_v3"),
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": key("nextn_predict_layers", 0), "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": heads,  # llama.cpp writes 1 (MLA as MQA)
        "q_lora_rank": key("attention.q_lora_rank", required=False), "kv_lora_rank": key("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key("attention.key_length_mla") - rope,
        "v_head_dim": key("attention.value_length_mla"),
        **({"index_n_heads": key("attention.indexer.head_count"), "index_head_dim": key("attention.indexer.key_length"),
            "index_topk": key("attention.indexer.top_k")} if indexer else {}),
        "n_routed_experts": key("expert_count"), "n_shared_experts": key("expert_shared_count", 0),
        "num_experts_per_tok": key("expert_used_count"), "first_k_dense_replace": key("leading_dense_block_count", 0),
        "n_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
        "scoring_func": _GATING[gating], "norm_topk_prob": bool(key("expert_weights_norm", False)),
        "routed_scaling_factor": key("expert_weights_scale", 1.0),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "rope_theta": key("rope.freq_base", 10000.0),
        "rope_scaling": scaling, "max_position_embeddings": key("context_length", 163840),
        "vocab_size": key.vocab_size(), "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    if arch == "glm-dsa":
        config["indexer_types"] = glm_gguf_indexer_types(key, layers)
    return deepseek_spec(config)


def glm_gguf_indexer_types(key: GGUFKeys, layers: int) -> list[str]:
    """`attention.indexer.types` (true = full); absent, llama.cpp's rule: every layer full before GLM-5.2
    (`context_length` < 1M), else GLM-5.2's pattern (layers 0, 1 and every 4th from 2: index_topk_freq 4,
    index_skip_topk_offset 3)."""
    types = key("attention.indexer.types", required=False)
    if types is not None:
        return ["full" if t else "shared" for t in list(types)[:layers]]
    if key("context_length", 0) < 1048576:
        return ["full"] * layers
    return ["full" if i < 2 or (i - 2) % 4 == 0 else "shared" for i in range(layers)]


GGUF_LAYER = {**MOE_GGUF, **{f"{g}.weight": f"self_attn.{h}.weight" for g, h in MLA_GGUF.items()},
              **{f"indexer.{g}.weight": f"self_attn.indexer.{h}.weight"
                 for g, h in (("attn_q_b", "wq_b"), ("attn_k", "wk"), ("k_norm", "k_norm"), ("proj", "weights_proj"))},
              "indexer.k_norm.bias": "self_attn.indexer.k_norm.bias"}


def gguf_tensors(architecture: str) -> TensorMap:
    return gguf_moe_tensors(GGUF_LAYER)


DEEPSEEK = register(ModelFamily(name="deepseek_v32", model_types=("deepseek_v32", "deepseek_v3", "glm_moe_dsa"),
                           spec_from_hf=deepseek_spec, hf_tensors=HF_TENSORS,
                           experts=experts("model."), gguf_architectures=("deepseek32", "deepseek2", "glm-dsa"),
                           spec_from_gguf=spec_from_gguf, gguf_tensors=gguf_tensors, gguf_finish=mla_finish,
                           gguf_experts=gguf_stacked_experts()))
