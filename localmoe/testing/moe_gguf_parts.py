"""What every generated MoE GGUF shares (`localmoe.testing.moe_gguf`, `localmoe.testing.k3_gguf`): the ggml type
llama-quantize gives each tensor, the encoder of each type, and the llama.cpp layouts two architectures share
(MLA's split kv_b_proj, Kimi-Linear's metadata and convolutions)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from localmoe.testing.ggml_blocks import STEP_FIELDS, random_blocks

PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# largest |value| / step of random blocks (else the K-quants' 945 = 63 * 15): Q2_K 15 * 3, Q3_K 32 * 4,
# IQ4 127 * (6-bit scale), IQ2
# (0.5 + 15) * 0.25 * 43, IQ3_XXS (0.5 + 15) * 0.5 * 62, IQ3_S 31 * 15, IQ1 15 * 1.125
AMPLITUDE = {"IQ4_NL": 127, "IQ4_XS": 32 * 127, "IQ2_XXS": 167, "IQ2_XS": 167, "IQ2_S": 167, "IQ3_XXS": 480,
             "IQ3_S": 465, "IQ1_S": 17, "IQ1_M": 17, "TQ1_0": 1, "TQ2_0": 2, "Q2_K": 45, "Q3_K": 128}


def _kv_b_split(kv_b: np.ndarray, c: dict) -> list[np.ndarray]:
    """kv_b_proj [H (nope + v), r] -> k_b [H, r, nope] (transposed, for absorbed decode) and v_b [H, v, r]."""
    H, nope, v = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
    per_head = kv_b.reshape(H, nope + v, -1)
    return [np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])]


def _kv_b_join(parts: list[np.ndarray], c: dict) -> np.ndarray:
    k_b, v_b = parts
    return np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1).reshape(-1, k_b.shape[1])


def _kimi_linear_metadata(w, c: dict) -> None:
    arch, lin = w.arch, c["linear_attn_config"]  # kimi-linear, or kimi-k3 (testing/k3_gguf.py adds its keys)
    w.add_context_length(c["model_max_length"])
    w.add_embedding_length(c["hidden_size"])
    w.add_block_count(c["num_hidden_layers"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv([1 if i + 1 in lin["full_attn_layers"] else 0 for i in range(c["num_hidden_layers"])])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_expert_count(c["num_experts"])
    w.add_expert_used_count(c["num_experts_per_token"])
    w.add_uint32(f"{arch}.expert_gating_func", 2)
    w.add_expert_group_used_count(c["topk_group"])
    w.add_uint32(f"{arch}.vocab_size", c["vocab_size"])
    w.add_uint32(f"{arch}.ssm.conv_kernel", lin["short_conv_kernel_size"])
    w.add_uint32(f"{arch}.kda.head_dim", lin["head_dim"])
    w.add_uint32(f"{arch}.attention.kv_lora_rank", c["kv_lora_rank"])
    w.add_rope_dimension_count(c["qk_rope_head_dim"])
    w.add_key_length(c["kv_lora_rank"] + c["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.key_length_mla", c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    w.add_uint32(f"{arch}.attention.value_length_mla", c["v_head_dim"])
    w.add_expert_feed_forward_length(c["moe_intermediate_size"])
    w.add_uint32(f"{arch}.expert_shared_count", c["num_shared_experts"])
    w.add_uint32(f"{arch}.leading_dense_block_count", c["first_k_dense_replace"])
    w.add_float32(f"{arch}.expert_weights_scale", c["routed_scaling_factor"])


def _conv_split(v: np.ndarray, c: dict) -> list[np.ndarray]:
    return [v.reshape(1, v.shape[0], 1, v.shape[-1])]  # [H K, 1, W] -> llama.cpp's [1, H K, 1, W]


def _conv_join(parts: list[np.ndarray], c: dict) -> np.ndarray:
    return parts[0].reshape(parts[0].shape[1], 1, parts[0].shape[-1])


def _a_split(v: np.ndarray, c: dict) -> list[np.ndarray]:
    import torch

    return [(-torch.from_numpy(v).exp()).numpy()]  # llama.cpp stores -exp(A_log)


def _a_join(parts: list[np.ndarray], c: dict) -> np.ndarray:
    import torch

    return torch.log(-torch.from_numpy(parts[0])).numpy()


def _use_more_bits(i: int, n: int) -> bool:
    """llama-quantize's layers that get the larger type in a *_M mix."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


# the routed experts' types of the "iq_dynamic" mix, by (layer * 3 + projection) in turn: as a community dynamic
# quant gives them per tensor with llama-quantize's --tensor-type overrides (3 MoE layers meet each type once)
IQ_DYNAMIC = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "Q2_K", "Q3_K")
# llama-quantize's type for rows that are not whole blocks of the chosen type (tensor_type_fallback)
_FALLBACK = {**{t: "IQ4_NL" for t in ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")},
             **{t: "Q4_0" for t in ("Q2_K", "Q3_K", "TQ1_0", "TQ2_0")}, "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


def _q4_k_m(name: str, shape: tuple[int, ...], layers: int, experts: int) -> str:
    """llama-quantize's Q4_K_M choice for tensor `name` (llama_tensor_get_type_impl, the categories a MoE
    GGUF of ours has): output Q6_K (Q8_0 where its rows are not whole 256-blocks); with 8 experts attn_k /
    attn_v / attn_qkv Q8_0 and attn_output Q5_K; attn_v-like and ffn_down on the `_use_more_bits` layers
    Q6_K; everything else Q4_K."""
    if name == "output.weight":
        return "Q6_K" if shape[-1] % 256 == 0 else "Q8_0"
    layer = int(name.split(".")[1]) if name.startswith("blk.") else 0
    attn_v = any(f".{k}.weight" in name for k in ("attn_v", "attn_qkv", "attn_kv_b"))
    if experts == 8 and (attn_v or "attn_k.weight" in name):
        return "Q8_0"
    if experts == 8 and "attn_output.weight" in name:
        return "Q5_K"
    if (attn_v or ".ffn_down" in name) and _use_more_bits(layer, layers):
        return "Q6_K"
    return "Q4_K"


def ggml_type_for(name: str, shape: tuple[int, ...], types: str, layers: int, experts: int = 0):
    """The ggml type `types` gives GGUF tensor `name` of a model with `layers` layers and `experts` routed
    experts (F32 for what convert_hf_to_gguf.py keeps F32); rows that are not whole blocks of it take
    llama-quantize's fallback type, then F16."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if (len(shape) < 2 or not name.endswith(".weight") or name.endswith(("_norm.weight", "ffn_gate_inp.weight",
                                                                          "ffn_gate_inp_shexp.weight",
                                                                          "indexer.proj.weight"))
            or ".ssm_conv1d" in name or ".hc_" in name or "indexer_compressor_" in name):
        return Q.F32  # convert_hf_to_gguf.py keeps these F32 (vectors, norms, routers, convs, ssm_a, biases, mHC)
    if types == "f32":
        return Q.F32
    if types == "iq_dynamic" and name.endswith("_exps.weight"):
        proj = ("gate", "up", "down").index(name.split(".")[2].removeprefix("ffn_").removesuffix("_exps"))
        kind = IQ_DYNAMIC[(int(name.split(".")[1]) * 3 + proj) % len(IQ_DYNAMIC)]
    elif types == "mxfp4_moe":  # llama-quantize's MXFP4_MOE: MoE tensors MXFP4, the others Q8_0
        kind = "MXFP4" if name.endswith("_exps.weight") else "Q8_0"
    elif types in ("q4_k_m", "iq_dynamic"):
        kind = _q4_k_m(name, shape, layers, experts)
    else:
        kind = types.upper()
    if shape[-1] % gguf.GGML_QUANT_SIZES[Q[kind]][0]:
        kind = _FALLBACK.get(kind, kind)
        if shape[-1] % gguf.GGML_QUANT_SIZES[Q[kind]][0]:
            return Q.F16
    return Q[kind]


def _encode(values: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """float32 [..., cols] -> the stored array for `qtype` (bytes for block types)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype in (Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.MXFP4):
        return gguf.quants.quantize(values.astype(np.float32), qtype)
    if qtype not in STEP_FIELDS:
        raise ValueError(f"write_moe_gguf cannot make {qtype.name} blocks")
    # K-quants, IQ4: random blocks whose largest values are about the weights' (|value| <= step * AMPLITUDE)
    rows = int(np.prod(values.shape[:-1]))
    amax = float(np.abs(values).max()) or 1e-2
    amplitude = AMPLITUDE.get(qtype.name, 945)  # K-quants: 6-bit scale x 4-bit code, 63 * 15
    step = (amax / amplitude / 2, amax / amplitude * 1.5)
    return random_blocks(qtype, rows, values.shape[-1], rng, step).reshape(*values.shape[:-1], -1)


def add_encoded(w, name: str, values: np.ndarray, qtype, rng: np.random.Generator) -> None:
    """Tensor `name` into GGUF writer `w`, stored as `qtype` (`_encode`)."""
    import gguf

    w.add_tensor(name, _encode(values, qtype, rng), raw_dtype=None if qtype == gguf.GGMLQuantizationType.F32 else qtype)


def finish_gguf(w, tmp: Path, dst: Path) -> Path:
    """Write writer `w`'s header, metadata and tensors to `tmp`, then move it to `dst` (never half a file there)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, dst)
    return dst
