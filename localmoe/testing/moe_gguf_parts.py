"""What every generated MoE GGUF shares (`localmoe.testing.moe_gguf`, `localmoe.testing.k3_gguf`): the ggml type
llama-quantize gives each tensor, the encoder of each type, and the llama.cpp layouts two architectures share
(MLA's split kv_b_proj, Kimi-Linear's metadata and convolutions)."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from localmoe.testing.ggml_blocks import STEP_FIELDS, random_blocks

PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
AMPLITUDE = {"IQ4_NL": 127, "IQ4_XS": 32 * 127}  # largest |value| / step of random blocks (else K-quants' 945)


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


def ggml_type_for(name: str, shape: tuple[int, ...], types: str, layers: int):
    """The ggml type `types` gives GGUF tensor `name` (None: F32)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if (len(shape) < 2 or not name.endswith(".weight") or name.endswith(("_norm.weight", "ffn_gate_inp.weight",
                                                                          "ffn_gate_inp_shexp.weight",
                                                                          "indexer.proj.weight"))
            or ".ssm_conv1d" in name):
        return Q.F32  # convert_hf_to_gguf.py keeps these F32 (vectors, norms, routers, convs, ssm_a, biases)
    if types == "f32":
        return Q.F32
    if types == "q4_k_m":
        more = name.startswith("blk.") and _use_more_bits(int(name.split(".")[1]), layers)
        if name == "output.weight" or (more and (".attn_v." in name or ".ffn_down" in name)):
            qtype = Q.Q6_K
        else:
            qtype = Q.Q4_K
    else:
        qtype = Q[types.upper()]
    if shape[-1] % gguf.GGML_QUANT_SIZES[qtype][0]:
        return Q.F32  # rows too short for the blocks: llama-quantize falls back to a float type too
    return qtype


def _encode(values: np.ndarray, qtype, rng: np.random.Generator) -> np.ndarray:
    """float32 [..., cols] -> the stored array for `qtype` (bytes for block types)."""
    import gguf

    Q = gguf.GGMLQuantizationType
    if qtype == Q.F32:
        return values.astype(np.float32)
    if qtype in (Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0):
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
