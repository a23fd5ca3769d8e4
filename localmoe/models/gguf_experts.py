"""What the MoE families share about llama.cpp's GGUF layout: metadata read as the HF config it came
from, stacked `blk.N.ffn_{gate,up,down}_exps.weight` [E, rows, cols] split into the canonical
per-expert `layers.N.mlp.experts.{e}.{gate,up,down}.weight`, MLA's `kv_b_proj` joined back from
llama.cpp's `attn_k_b` / `attn_v_b`, and the tensors names that DeepSeek-style MoE layers share.

The stacked tensors arrive as the loader reads them: float tensors (F32 / F16 / BF16, converted to
fp32 when taken) or, for every block type, a 3-D `BlockQuantized` over the file's bytes; each
expert becomes a view (expert e's rows of blocks), so nothing is copied or dequantised here.
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.engine.quantized import BlockQuantized
from localmoe.errors import CheckpointError, UnsupportedModelError
from localmoe.models.base import ExpertTensors, TensorMap, TensorRule, gguf_float
from localmoe.quant.mxfp4 import GGML_BLOCK_BYTES, ggml_to_canonical

PROJECTIONS = ("gate", "up", "down")
STACKED = "layers.{i}.mlp.experts.{p}_exps"  # canonical name of a stacked tensor until gguf_finish splits it


class GGUFKeys:
    """`{arch}.*` metadata values; CheckpointError naming a missing key. Float32 values come back as
    the decimals they were written from (`gguf_float`)."""

    def __init__(self, metadata: dict, arch: str):
        self.metadata, self.arch = metadata, arch

    def __call__(self, name: str, default=None, required: bool = True):
        value = self.metadata.get(f"{self.arch}.{name}", default)
        if value is None and required:
            raise CheckpointError(f"GGUF metadata lacks {self.arch}.{name}")
        return gguf_float(value) if isinstance(value, float) else value

    def vocab_size(self) -> int:
        return self.metadata.get(f"{self.arch}.vocab_size") or len(self.metadata.get("tokenizer.ggml.tokens", ()))

    def rope_scaling(self) -> dict | None:
        """`rope.scaling.*` as an HF `rope_scaling` (YaRN and linear; none when absent)."""
        kind = self.metadata.get(f"{self.arch}.rope.scaling.type")
        if kind in (None, "none"):
            return None
        scaling = {"rope_type": kind, "factor": self("rope.scaling.factor")}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = self("rope.scaling.original_context_length")
            for key, hf in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if (value := self(f"rope.scaling.{key}", required=False)) is not None:
                    scaling[hf] = value
        return scaling


def kimi_linear_config(key: GGUFKeys, tensor_names: set) -> dict:
    """The Kimi-Linear-style HF text config (MLA where `head_count_kv` > 0, KDA elsewhere, sigmoid-routed
    MoE) that `{arch}.*` metadata was converted from; Kimi K3 adds its own keys on top."""
    layers, heads, rope = key("block_count"), key("attention.head_count"), key("rope.dimension_count")
    kv_heads = key("attention.head_count_kv")
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    full = [i + 1 for i, n in enumerate(kv_heads) if n]
    gating = key("expert_gating_func", 2)
    if gating != 2:
        raise UnsupportedModelError(f"GGUF {key.arch}.expert_gating_func {gating} is not supported (sigmoid, 2, only)")
    return {
        "model_type": "kimi_linear", "num_hidden_layers": layers, "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"), "moe_intermediate_size": key("expert_feed_forward_length"),
        "num_attention_heads": heads, "num_key_value_heads": heads,
        "q_lora_rank": key("attention.q_lora_rank", required=False), "kv_lora_rank": key("attention.kv_lora_rank"),
        "qk_rope_head_dim": rope, "qk_nope_head_dim": key("attention.key_length_mla") - rope,
        "v_head_dim": key("attention.value_length_mla"), "mla_use_nope": True,
        "linear_attn_config": {"full_attn_layers": full, "kda_layers": [i for i in range(1, layers + 1) if i not in full],
                               "num_heads": heads, "head_dim": key("kda.head_dim"),
                               "short_conv_kernel_size": key("ssm.conv_kernel", 4)},
        "num_experts": key("expert_count"), "num_experts_per_token": key("expert_used_count"),
        "num_shared_experts": key("expert_shared_count", 0), "first_k_dense_replace": key("leading_dense_block_count", 0),
        "moe_renormalize": bool(key("expert_weights_norm", True)),
        "routed_scaling_factor": key("expert_weights_scale", 1.0),
        "num_expert_group": key("expert_group_count", 1), "topk_group": key("expert_group_used_count", 1),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"), "model_max_length": key("context_length", 1048576),
        "vocab_size": key.vocab_size(), "tie_word_embeddings": "output.weight" not in tensor_names,
    }


def stacked_expert_rules() -> tuple[TensorRule, ...]:
    """`blk.{i}.ffn_{p}_exps.weight` -> the stacked canonical name `gguf_finish` splits."""
    return tuple(TensorRule(f"blk.{{i}}.ffn_{p}_exps.weight", STACKED.replace("{p}", p)) for p in PROJECTIONS)


def gguf_moe_tensors(layer: dict, ignore: tuple[str, ...] = ()) -> TensorMap:
    """A llama.cpp MoE GGUF's TensorMap: token_embd / output_norm / output, `blk.{i}.{name}` -> `layers.{i}.{canonical}`
    for each entry of `layer` (the canonical name, or (canonical name, transform)), the stacked routed experts."""
    pairs = ((g, (h, None) if isinstance(h, str) else h) for g, h in layer.items())
    return TensorMap(rules=(
        TensorRule("token_embd.weight", "embed_tokens.weight"), TensorRule("output_norm.weight", "norm.weight"),
        TensorRule("output.weight", "lm_head.weight"),
        *(TensorRule(f"blk.{{i}}.{g}", f"layers.{{i}}.{h}", fix) for g, (h, fix) in pairs), *stacked_expert_rules(),
    ), ignore=ignore)


def mla_finish(weights: dict, spec: ModelSpec) -> dict:
    """A DeepSeek-style MLA GGUF's `gguf_finish`: attention matrices kept in blocks dequantised, kv_b_proj
    joined back (join_kv_b), routed experts split per expert (the MTP block's tensors never got here:
    checkpoint.tensor_names leaves `ModelSpec.nextn_layers` out)."""
    dequantize_attention(weights)
    join_kv_b(weights, spec)
    return unstack_experts(weights, spec)


def gguf_stacked_experts() -> ExpertTensors:
    """The converter's view of the same tensors: stacked, any ggml type (convert/experts.py)."""
    return ExpertTensors("ggml", {p: f"blk.{{i}}.ffn_{p}_exps" for p in PROJECTIONS}, stacked=True)


def as_float(t) -> torch.Tensor:
    """A GGUF tensor as the loader gave it (a float tensor or BlockQuantized) in fp32."""
    return t.float()


def _expert(t, e: int):
    if isinstance(t, BlockQuantized):
        return BlockQuantized(t.raw[e], t.ggml_type, t.shape[1:])
    return t[e]


def unstack_experts(weights: dict, spec: ModelSpec) -> dict:
    """`gguf_finish` of the stacked-expert families: each MoE layer's stacked gate / up / down become
    per-expert `layers.{i}.mlp.experts.{e}.{p}.weight` views (floats or their ggml blocks), or, for ggml
    MXFP4 experts (gpt-oss / K3 by birth, llama-quantize's MXFP4_MOE for the others), the canonical MXFP4
    `.packed` / `.scales` (bytes moved); a missing one leaves its canonical tensors missing, for the shape
    checks to name."""
    for i in spec.moe_layers():
        for p in PROJECTIONS:
            name = STACKED.format(i=i, p=p)
            if name not in weights:
                continue
            stacked = weights.pop(name)
            if stacked.shape[0] != spec.num_experts:
                raise CheckpointError(f"tensor blk.{i}.ffn_{p}_exps.weight holds {stacked.shape[0]} experts, the "
                                      f"metadata says {spec.num_experts}")
            x = f"layers.{i}.mlp.experts.{{e}}.{p}."
            if isinstance(stacked, torch.Tensor) and stacked.dtype == torch.uint8:  # the loader's stacked MXFP4 bytes
                packed, scales = ggml_to_canonical(stacked.reshape(*stacked.shape[:2], -1, GGML_BLOCK_BYTES))
                for e in range(spec.num_experts):
                    weights[x.format(e=e) + "packed"], weights[x.format(e=e) + "scales"] = packed[e], scales[e]
                continue
            if isinstance(stacked, torch.Tensor) and stacked.is_floating_point():
                stacked = stacked.float()
            for e in range(spec.num_experts):
                weights[x.format(e=e) + "weight"] = _expert(stacked, e)
    return weights


def join_kv_b(weights: dict, spec: ModelSpec) -> None:
    """MLA's kv_b_proj [H (nope + v), r] from llama.cpp's per-head k_b [H, r, nope] (transposed for the
    absorbed decode) and v_b [H, v, r], canonical `self_attn.k_b.weight` / `v_b.weight`."""
    for i in range(spec.num_layers):
        a = f"layers.{i}.self_attn."
        if a + "k_b.weight" in weights and a + "v_b.weight" in weights:
            k_b, v_b = as_float(weights.pop(a + "k_b.weight")), as_float(weights.pop(a + "v_b.weight"))
            weights[a + "kv_b_proj.weight"] = torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(-1, k_b.shape[1])


# `self_attn.*` matrices the MLA and KDA builders take in their blocks (engine/linear.py make_linear: a BlockLinear,
# parts of different types as segments, which the decode plans read as they are)
BLOCK_PROJECTIONS = frozenset(f"{p}.weight" for p in (
    "q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj", "g_proj", "g_a_proj", "g_b_proj", "f_b_proj", "o_proj",
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa"))


def dequantize_attention(weights: dict, markers: tuple[str, ...] = (".self_attn.",)) -> None:
    """Attention matrices kept in blocks (--dtype auto) as fp32 where their builders take floats (`markers`: the
    name parts of the tensors to dequantise): the indexer's, Gated DeltaNet's, MLA's k_b / v_b (join_kv_b). The MLA
    and KDA projections directly under `self_attn.` (BLOCK_PROJECTIONS) stay in their blocks: dequantised they were
    bf16 Linears, 31 MB per K3 small Q4_K_M token where the file holds 9 MB of blocks."""
    for name in [n for n in weights if any(m in n for m in markers)]:
        if ".self_attn." in name and name.split(".self_attn.")[-1] in BLOCK_PROJECTIONS:
            continue
        if isinstance(weights[name], BlockQuantized):
            weights[name] = weights[name].float()


MLA_GGUF = {"attn_q_a": "q_a_proj", "attn_q_a_norm": "q_a_layernorm", "attn_q_b": "q_b_proj", "attn_q": "q_proj",
            "attn_kv_a_mqa": "kv_a_proj_with_mqa", "attn_kv_a_norm": "kv_a_layernorm", "attn_output": "o_proj",
            "attn_k_b": "k_b", "attn_v_b": "v_b"}  # llama.cpp name -> canonical `self_attn.*` (k_b / v_b: join_kv_b)


def _conv_from_gguf(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """[1, H K, 1, W] (llama.cpp) -> [H K, 1, W]."""
    return t.reshape(t.shape[-3], 1, t.shape[-1])


def _a_log_from_gguf(t: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    """llama.cpp stores -exp(A_log)."""
    return torch.log(-t)


# KDA (kimi-linear, glm5-next): llama.cpp name -> (canonical `self_attn.*`, transform)
KDA_GGUF = {**{f"attn_{x}.weight": (f"{x}_proj.weight", None) for x in "qkv"},
            **{f"ssm_conv1d_{x}.weight": (f"{x}_conv1d.weight", _conv_from_gguf) for x in "qkv"},
            "ssm_f_a.weight": ("f_a_proj.weight", None), "ssm_f_b.weight": ("f_b_proj.weight", None),
            "ssm_beta.weight": ("b_proj.weight", None), "ssm_g_a.weight": ("g_a_proj.weight", None),
            "ssm_g_b.weight": ("g_b_proj.weight", None), "ssm_a": ("A_log", _a_log_from_gguf),
            "ssm_dt.bias": ("dt_bias", None), "ssm_norm.weight": ("o_norm.weight", None)}
# DeepSeek-style MoE and norms: llama.cpp name under `blk.{i}.` -> canonical name under `layers.{i}.`
MOE_GGUF = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
            "ffn_gate_inp.weight": "mlp.router.weight", "exp_probs_b.bias": "mlp.router.e_score_correction_bias",
            **{f"ffn_{p}_shexp.weight": f"mlp.shared_experts.{p}_proj.weight" for p in PROJECTIONS},
            **{f"ffn_{p}.weight": f"mlp.{p}_proj.weight" for p in PROJECTIONS}}
