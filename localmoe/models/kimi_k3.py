"""Kimi K3 (`kimi_k3`): Kimi-Linear's text model with K3's changes (MODELS.md).

Checkpoint facts: config under `text_config`; tensors prefixed `language_model.`; routed
experts in compressed-tensors `mxfp4-pack-quantized` (`w1/w3/w2.weight_packed` +
`weight_scale`, element 2i in the low nibble = our canonical MXFP4 layout, so they load
as they are) over the latent width; layer lists 1-indexed.

Quirks, each covered by tests/models/test_kimi_k3.py:
- KDA: bounded decay gate (`gate_lower_bound` * sigmoid), full-rank `g_proj` output gate,
  `A_log` stored padded to max(H, K) (first H live).
- MLA: q LoRA (`q_a_proj` -> `q_a_layernorm` -> `q_b_proj`), NoPE, sigmoid output gate `g_proj`.
- latent MoE: `routed_expert_down_proj` -> experts (SiTU-GLU) -> `routed_expert_norm` ->
  `routed_expert_up_proj`; sigmoid router with correction bias; 2 shared experts fused.
- attention residuals (`attn_res_block_size`): `self_attention_res_*`, `mlp_res_*`,
  `model.output_attn_res_*` (engine/layers/attn_res.py).
- a `vision_config` adds the MoonViT tower and projector (`vision_tower.*`, `mm_projector.*`, as Kimi K2.5's;
  tests/models/test_kimi_k3_vision.py); without one, tower tensors in the checkpoint stay unused.

GGUF (`kimi-k3`, llama.cpp's layout; tests/models/test_moe_gguf.py): Kimi-Linear's names (models/kimi_linear.py)
plus `ssm_g` (KDA's full-rank gate) and `attn_gate` (MLA's output gate), both `g_proj`; `ssm_a` holds
-exp(A_log[:H]) (read back as log(-ssm_a), padded with zeros to max(H, K)); the latent MoE as
`ffn_routed_{down,norm,up}`; each attention-residual pair fused into `{attn,ffn,output}_res_score` =
res_norm * res_proj (read back as a norm of ones and the score as proj: the mix multiplies the two); routed
experts stacked ggml MXFP4 without biases, repacked to the canonical MXFP4 per expert (bytes moved); a file
whose experts were requantised (Q4_K, IQ2_XXS, ... as community quants do) keeps them in their blocks.
"""

from __future__ import annotations

import dataclasses

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers import attn_res, moe, vision_moonvit
from localmoe.engine.transformer import model_tensors
from localmoe.errors import UnsupportedModelError
from localmoe.models import register
from localmoe.models.base import ExpertTensors, ModelFamily, TensorMap, TensorRule
from localmoe.models.gguf_experts import (
    MLA_GGUF,
    MOE_GGUF,
    PROJECTIONS,
    GGUFKeys,
    dequantize_attention,
    join_kv_b,
    kimi_linear_config,
    stacked_expert_rules,
    unstack_experts,
)
from localmoe.models.moe_config import kimi_text_spec, require

SOURCE = "config.json text_config"


def spec_from_hf(config: dict) -> ModelSpec:
    text = require(config, "text_config")
    spec = kimi_text_spec(text, "kimi_k3", "kimi_k3", SOURCE)
    act = text.get("moe_router_activation_func", "sigmoid")
    if act != "sigmoid":
        raise UnsupportedModelError(f"kimi_k3: moe_router_activation_func {act!r} is not supported (sigmoid only)")
    if not text.get("latent_moe_use_norm", True):
        raise UnsupportedModelError("kimi_k3: latent MoE without routed_expert_norm is not supported")
    return dataclasses.replace(
        spec, scoring_func="sigmoid",
        # hidden_act (situ) drives the dense layer-0 MLP and the shared experts, as HF's Kimi MLPs
        # read it; the routed experts are SiTU-GLU too (MODELS.md)
        expert_act="situ",
        situ_beta=float(text.get("activation_situ_beta", 4.0)),
        situ_linear_beta=float(text.get("activation_situ_linear_beta", 25.0)),
        norm_topk_prob=bool(text.get("moe_renormalize", True)),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        n_group=int(text.get("num_expert_group") or 1), topk_group=int(text.get("topk_group") or 1),
        attn_res=attn_res.Config(int(require(text, "attn_res_block_size", SOURCE)), spec.num_layers, spec.hidden_size,
                                 spec.rms_norm_eps),
        **_vision(config, spec.hidden_size))


def _vision(config: dict, text_hidden: int) -> dict:
    """The MoonViT tower when the config has a `vision_config` (engine/layers/vision_moonvit.py); image
    placeholder `media_placeholder_token_id` (or `image_token_id`), 163605 by default."""
    if not config.get("vision_config"):
        return {}
    eps = config.get("projection_layer_norm_eps", config["vision_config"].get("projector_ln_eps", 1e-5))
    return {"vision": vision_moonvit.Config.from_hf(config["vision_config"], text_hidden, eps),
            "image_token_id": int(config.get("media_placeholder_token_id", config.get("image_token_id", 163605)))}


_P = "language_model.model."
_ATTN = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "q_conv1d.weight", "k_conv1d.weight",
         "v_conv1d.weight", "f_a_proj.weight", "f_b_proj.weight", "b_proj.weight", "g_proj.weight", "A_log",
         "dt_bias", "o_norm.weight", "o_proj.weight",  # KDA (g_proj: its full-rank gate)
         "q_a_proj.weight", "q_a_layernorm.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight",
         "kv_a_layernorm.weight", "kv_b_proj.weight"]  # MLA (+ o_proj, g_proj: its output gate)
_LAYER = ["input_layernorm.weight", "post_attention_layernorm.weight",
          *(f"{s}_res_{t}.weight" for s in ("self_attention", "mlp") for t in ("norm", "proj")),
          *(f"self_attn.{t}" for t in _ATTN), *(f"mlp.{m}_proj.weight" for m in ("gate", "up", "down"))]
_MOE = [("gate.weight", "router.weight"), ("gate.e_score_correction_bias", "router.e_score_correction_bias"),
        *((f"{n}.weight",) * 2 for n in ("routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj")),
        *((f"shared_experts.{n}_proj.weight",) * 2 for n in ("gate", "up", "down")),
        *((f"experts.{{e}}.{w}.weight_{kind}", f"experts.{{e}}.{proj}.{part}")
          for w, proj in (("w1", "gate"), ("w3", "up"), ("w2", "down"))
          for kind, part in (("packed", "packed"), ("scale", "scales")))]

HF_TENSORS = TensorMap(
    rules=(
        TensorRule(_P + "embed_tokens.weight", "embed_tokens.weight"),
        TensorRule(_P + "norm.weight", "norm.weight"),
        *(TensorRule(f"{_P}output_attn_res_{t}.weight", f"output_attn_res_{t}.weight") for t in ("norm", "proj")),
        TensorRule("language_model.lm_head.weight", "lm_head.weight"),
        *(TensorRule(f"{_P}layers.{{i}}.{n}", f"layers.{{i}}.{n}") for n in _LAYER),
        *(TensorRule(f"{_P}layers.{{i}}.block_sparse_moe.{src}", f"layers.{{i}}.mlp.{dst}") for src, dst in _MOE),
        *(TensorRule(n, n) for n in vision_moonvit.name_patterns()),  # read when the config has a vision_config
    ),
    ignore=(r"rotary_emb\.inv_freq$", r"^multi_modal_projector\."),
)


def mxfp4_expert_shapes(cfg: moe.Config, m: str) -> dict[str, tuple[int, ...]]:
    """Routed experts as MXFP4 parts: packed U8 [out, in/2] and scales U8 [out, in/32]."""
    Im, W, shapes = cfg.moe_intermediate_size, cfg.width, {}
    for e in range(cfg.num_experts):
        x = f"{m}experts.{e}."
        for proj, (out, inp) in (("gate", (Im, W)), ("up", (Im, W)), ("down", (W, Im))):
            shapes |= {f"{x}{proj}.packed": (out, inp // 2), f"{x}{proj}.scales": (out, inp // 32)}
    return shapes


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Canonical tensor shapes: Kimi-Linear's layers with MXFP4 routed experts, plus attention residuals."""
    return model_tensors(spec, mxfp4_expert_shapes)


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    """The spec of the HF config the `kimi-k3.*` metadata was converted from (text only: llama.cpp skips the
    tower)."""
    key = GGUFKeys(metadata, "kimi-k3")
    text = kimi_linear_config(key, tensor_names)
    text["linear_attn_config"].update(gate_lower_bound=key("kda.gate_lower_bound", -5.0), use_full_rank_gate=True)
    text.update({
        "routed_expert_hidden_size": key("expert_latent_length"),
        "mla_use_output_gate": any(n.endswith(".attn_gate.weight") for n in tensor_names),
        "attn_res_block_size": key("attn_res.block_size"),
        "hidden_act": "situ", "activation_situ_beta": key("activation.situ_beta"),
        "activation_situ_linear_beta": key("activation.situ_linear_beta"),
    })
    return spec_from_hf({"model_type": "kimi_k3", "text_config": text})


def _conv_from_gguf(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[1, H K, 1, W] (llama.cpp) -> [H K, 1, W]."""
    return t.reshape(t.shape[-3], 1, t.shape[-1])


_GGUF_KDA = {**{f"attn_{x}.weight": f"{x}_proj.weight" for x in "qkv"},
             **{f"ssm_conv1d_{x}.weight": f"{x}_conv1d.weight" for x in "qkv"},
             "ssm_f_a.weight": "f_a_proj.weight", "ssm_f_b.weight": "f_b_proj.weight", "ssm_beta.weight": "b_proj.weight",
             "ssm_g.weight": "g_proj.weight", "attn_gate.weight": "g_proj.weight", "ssm_a": "A_log",
             "ssm_dt.bias": "dt_bias", "ssm_norm.weight": "o_norm.weight"}
_GGUF_RES = {"attn_res_score.weight": "self_attention_res_proj.weight", "ffn_res_score.weight": "mlp_res_proj.weight"}
_GGUF_LATENT = {f"ffn_routed_{p}.weight": f"mlp.routed_expert_{p}{'' if p == 'norm' else '_proj'}.weight"
                for p in ("down", "norm", "up")}


def gguf_tensors(architecture: str) -> TensorMap:
    """llama.cpp's `kimi-k3` names -> canonical ones (`gguf_finish` completes A_log, the residual norms, experts)."""
    layer = {**{f"{g}.weight": f"self_attn.{h}.weight" for g, h in MLA_GGUF.items()},
             **{g: f"self_attn.{h}" for g, h in _GGUF_KDA.items()}, **MOE_GGUF, **_GGUF_RES, **_GGUF_LATENT}
    conv = {f"ssm_conv1d_{x}.weight" for x in "qkv"}
    return TensorMap(rules=(
        TensorRule("token_embd.weight", "embed_tokens.weight"), TensorRule("output_norm.weight", "norm.weight"),
        TensorRule("output.weight", "lm_head.weight"), TensorRule("output_res_score.weight", "output_attn_res_proj.weight"),
        *(TensorRule(f"blk.{{i}}.{g}", f"layers.{{i}}.{h}", _conv_from_gguf if g in conv else None)
          for g, h in layer.items()),
        *stacked_expert_rules(),
    ))


def gguf_finish(weights: dict, spec: ModelSpec) -> dict:
    """A_log from -exp(A_log[:H]) padded back to max(H, K); each fused residual score as a norm of ones and
    the score as proj [1, D]; kv_b_proj joined; attention matrices kept in blocks dequantised; each layer's
    stacked experts split per expert (unstack_experts): ggml MXFP4 ones (as llama.cpp's converter writes
    them) as canonical `experts.{e}.{p}.packed` / `.scales`, requantised ones (Q4_K, IQ2_XXS, ...) in their blocks."""
    dequantize_attention(weights)
    join_kv_b(weights, spec)
    pad = max(spec.kda.num_heads, spec.kda.head_dim) if spec.kda else 0
    for name in [n for n in weights if n.endswith(".A_log")]:
        a_log = torch.log(-weights[name].float().flatten())
        weights[name] = torch.cat([a_log, a_log.new_zeros(max(pad - a_log.numel(), 0))])
    for name in [n for n in weights if n.endswith("_res_proj.weight")]:
        score = weights[name].float().flatten()
        weights[name] = score[None]
        weights[name.replace("_res_proj.", "_res_norm.")] = torch.ones_like(score)
    return unstack_experts(weights, spec)


_EXPERT = "language_model.model.layers.{i}.block_sparse_moe.experts.{e}"

FAMILY = register(ModelFamily(
    name="kimi_k3",
    model_types=("kimi_k3",),
    spec_from_hf=spec_from_hf,
    gguf_architectures=("kimi-k3",),
    spec_from_gguf=spec_from_gguf,
    gguf_tensors=gguf_tensors,
    gguf_finish=gguf_finish,
    gguf_experts=ExpertTensors("ggml", {p: f"blk.{{i}}.ffn_{p}_exps" for p in PROJECTIONS}, stacked=True),
    hf_tensors=HF_TENSORS,
    expected_shapes=expected_shapes,
    # no tensor beyond those the config asks for, but a tower a text-only config leaves unused
    optional_tensors=(r"^(vision_tower|mm_projector)\.",),
    experts=ExpertTensors("compressed_tensors_mxfp4", {"gate": f"{_EXPERT}.w1", "up": f"{_EXPERT}.w3",
                                                       "down": f"{_EXPERT}.w2"}),
))
