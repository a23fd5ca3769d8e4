"""A generated Kimi K3 checkpoint written as llama.cpp's `kimi-k3` GGUF, and its dequantised twin
(`localmoe.testing.moe_gguf` for the other families; the same `types`).

llama.cpp's K3 layout (its conversion/kimi_k3.py): Kimi-Linear's names with the `language_model.` prefix
dropped, `g_proj` as `ssm_g` on KDA layers and `attn_gate` on MLA layers, `ssm_a` = -exp(A_log[:H]), the latent
MoE as `ffn_routed_{down,norm,up}`, each attention-residual pair fused into one `*_res_score` = norm * proj, and
the compressed-tensors MXFP4 experts repacked (bytes moved) to stacked ggml MXFP4 without biases.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from localmoe.quant.mxfp4 import GGML_BLOCK_BYTES, canonical_to_ggml, ggml_to_canonical
from localmoe.testing.gpt_oss_gguf import add_tokenizer
from localmoe.testing.moe_gguf_parts import (
    PROJ,
    _conv_join,
    _conv_split,
    _kimi_linear_metadata,
    _kv_b_join,
    _kv_b_split,
    add_encoded,
    finish_gguf,
    ggml_type_for,
)

P = "language_model.model."
LAYER = {  # HF -> GGUF under a layer, one to one
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    **{f"self_attn.{h}.weight": f"{g}.weight" for h, g in (
        ("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output"),
        ("f_a_proj", "ssm_f_a"), ("f_b_proj", "ssm_f_b"), ("b_proj", "ssm_beta"), ("o_norm", "ssm_norm"),
        ("q_a_proj", "attn_q_a"), ("q_a_layernorm", "attn_q_a_norm"), ("q_b_proj", "attn_q_b"),
        ("kv_a_proj_with_mqa", "attn_kv_a_mqa"), ("kv_a_layernorm", "attn_kv_a_norm"))},
    "self_attn.dt_bias": "ssm_dt.bias",
    "block_sparse_moe.gate.weight": "ffn_gate_inp.weight",
    "block_sparse_moe.gate.e_score_correction_bias": "exp_probs_b.bias",
    **{f"block_sparse_moe.routed_expert_{h}.weight": f"ffn_routed_{g}.weight"
       for h, g in (("down_proj", "down"), ("norm", "norm"), ("up_proj", "up"))},
    **{f"block_sparse_moe.shared_experts.{p}.weight": f"ffn_{s}_shexp.weight" for s, p in PROJ.items()},
    **{f"mlp.{p}.weight": f"ffn_{s}.weight" for s, p in PROJ.items()}}
RES = {"self_attention_res": "attn_res_score.weight", "mlp_res": "ffn_res_score.weight"}
EXPERT_W = {"gate": "w1", "up": "w3", "down": "w2"}


def _metadata(w, c: dict) -> None:
    _kimi_linear_metadata(w, c)
    a = w.arch
    w.add_uint32(f"{a}.attention.q_lora_rank", c["q_lora_rank"])
    w.add_value_length(c["kv_lora_rank"])
    w.add_bool(f"{a}.expert_weights_norm", bool(c["moe_renormalize"]))
    w.add_uint32(f"{a}.expert_latent_length", c["routed_expert_hidden_size"])
    w.add_float32(f"{a}.activation.situ_beta", c["activation_situ_beta"])
    w.add_float32(f"{a}.activation.situ_linear_beta", c["activation_situ_linear_beta"])
    w.add_uint32(f"{a}.attn_res.block_size", c["attn_res_block_size"])
    w.add_float32(f"{a}.kda.gate_lower_bound", c["linear_attn_config"]["gate_lower_bound"])


def _tensors(ckpt, c: dict):
    """(GGUF name, producer of float32 values or, for experts, of ggml MXFP4 bytes) in llama.cpp's order."""
    names = set(ckpt.keys())

    def f32(name):
        return lambda: ckpt.tensor(name).float().numpy()

    def fused(stem):
        return lambda: (ckpt.tensor(stem + "_norm.weight").float().flatten()
                        * ckpt.tensor(stem + "_proj.weight").float().flatten()).numpy()

    out = [("token_embd.weight", f32(P + "embed_tokens.weight"))]
    H, full = c["linear_attn_config"]["num_heads"], c["linear_attn_config"]["full_attn_layers"]
    for i in range(c["num_hidden_layers"]):
        p, b = f"{P}layers.{i}.", f"blk.{i}."
        out += [(b + dst, f32(p + src)) for src, dst in LAYER.items() if p + src in names]
        out += [(b + dst, fused(p + stem)) for stem, dst in RES.items()]
        out.append((b + ("attn_gate.weight" if i + 1 in full else "ssm_g.weight"), f32(p + "self_attn.g_proj.weight")))
        if p + "self_attn.A_log" in names:
            # in torch, as llama.cpp's converter computes it (numpy's exp may round another way)
            out.append((b + "ssm_a", lambda n=p + "self_attn.A_log": (-ckpt.tensor(n).float()[:H].exp()).numpy()))
            out += [(f"{b}ssm_conv1d_{x}.weight", lambda n=f"{p}self_attn.{x}_conv1d.weight": _conv_split(f32(n)(), c)[0])
                    for x in "qkv"]
        if p + "self_attn.kv_b_proj.weight" in names:
            out += [(b + g, lambda k=k, n=p + "self_attn.kv_b_proj.weight": _kv_b_split(f32(n)(), c)[k])
                    for k, g in enumerate(("attn_k_b.weight", "attn_v_b.weight"))]
        stem = p + "block_sparse_moe.experts.{e}." + "{w}.weight_"
        if stem.format(e=0, w="w1") + "packed" not in names:
            continue  # the dense layer
        for short, wid in EXPERT_W.items():
            out.append((f"{b}ffn_{short}_exps.weight", lambda wid=wid, stem=stem: np.stack([canonical_to_ggml(
                ckpt.tensor(stem.format(e=e, w=wid) + "packed"), ckpt.tensor(stem.format(e=e, w=wid) + "scale")
            ).reshape(ckpt.tensor(stem.format(e=e, w=wid) + "scale").shape[0], -1).numpy()
                for e in range(c["num_experts"])])))
    out += [("output_norm.weight", f32(P + "norm.weight")), ("output_res_score.weight", fused(P + "output_attn_res")),
            ("output.weight", f32("language_model.lm_head.weight"))]
    return out


def write_k3_gguf(src: Path, dst: Path, types: str = "f32", seed: int = 0) -> Path:
    """Write the generated K3 checkpoint `src` as llama.cpp's `kimi-k3` GGUF: experts ggml MXFP4, every other
    tensor in the type `types` gives it (`moe_gguf_parts.ggml_type_for`)."""
    import gguf

    from localmoe.store.safetensors import SafetensorsCheckpoint

    c = json.loads((src / "config.json").read_text())["text_config"]
    ckpt = SafetensorsCheckpoint(src)
    rng = np.random.default_rng(seed)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(tmp, "kimi-k3")
    w.add_name(f"localmoe test {src.name}")
    _metadata(w, c)
    add_tokenizer(w, src, c["vocab_size"], chat_template=True)
    for name, make in _tensors(ckpt, c):
        values = make()
        if name.endswith("_exps.weight"):
            w.add_tensor(name, values, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
            continue
        qtype = ggml_type_for(name, values.shape, types, c["num_hidden_layers"], c["num_experts"])
        add_encoded(w, name, values, qtype, rng)
    return finish_gguf(w, tmp, dst)


def write_k3_dequantized(src: Path, gguf_path: Path, dst: Path) -> Path:
    """The K3 checkpoint `src` again from the GGUF's values as `gguf.quants.dequantize` decodes them (F32); the
    MXFP4 experts back in compressed-tensors form (the same codes and scales), each residual score as a norm of
    ones and the score as proj, A_log padded with zeros to max(H, K)."""
    import gguf
    from safetensors.torch import save_file

    c = json.loads((src / "config.json").read_text())["text_config"]
    H, K = c["linear_attn_config"]["num_heads"], c["linear_attn_config"]["head_dim"]
    to_hf = {v: k for k, v in LAYER.items()} | {"ssm_g.weight": "self_attn.g_proj.weight",
                                                "attn_gate.weight": "self_attn.g_proj.weight"}
    top = {"token_embd.weight": P + "embed_tokens.weight", "output_norm.weight": P + "norm.weight",
           "output.weight": "language_model.lm_head.weight"}
    tensors: dict[str, torch.Tensor] = {}
    kv_b: dict[str, dict[str, np.ndarray]] = {}

    def res(stem: str, score: np.ndarray) -> None:
        tensors[stem + "_norm.weight"] = torch.ones(score.shape[-1])
        tensors[stem + "_proj.weight"] = torch.from_numpy(score.reshape(1, -1).copy())

    for t in gguf.GGUFReader(gguf_path).tensors:
        if t.tensor_type == gguf.GGMLQuantizationType.MXFP4:
            raw = torch.from_numpy(np.array(t.data, dtype=np.uint8))
            packed, scales = ggml_to_canonical(raw.reshape(*raw.shape[:2], -1, GGML_BLOCK_BYTES))
            i, short = t.name.split(".")[1], t.name.split(".")[2].removeprefix("ffn_").removesuffix("_exps")
            for e in range(packed.shape[0]):
                x = f"{P}layers.{i}.block_sparse_moe.experts.{e}.{EXPERT_W[short]}.weight_"
                tensors[x + "packed"], tensors[x + "scale"] = packed[e].clone(), scales[e].clone()
            continue
        values = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        values = values.reshape(tuple(int(n) for n in reversed(t.shape)))
        if t.name in top:
            tensors[top[t.name]] = torch.from_numpy(values.copy())
            continue
        if t.name == "output_res_score.weight":
            res(P + "output_attn_res", values)
            continue
        _, i, rest = t.name.split(".", 2)
        p = f"{P}layers.{i}."
        if rest in RES.values():
            res(p + {v: k for k, v in RES.items()}[rest], values)
        elif rest == "ssm_a":
            a_log = torch.log(-torch.from_numpy(values.copy()))  # as gguf_finish reads it
            tensors[p + "self_attn.A_log"] = torch.cat([a_log, a_log.new_zeros(max(H, K) - H)])
        elif rest.startswith("ssm_conv1d_"):
            tensors[f"{p}self_attn.{rest[11]}_conv1d.weight"] = torch.from_numpy(_conv_join([values], c).copy())
        elif rest in ("attn_k_b.weight", "attn_v_b.weight"):
            got = kv_b.setdefault(p, {})
            got[rest] = values
            if len(got) == 2:
                joined = _kv_b_join([got["attn_k_b.weight"], got["attn_v_b.weight"]], c)
                tensors[p + "self_attn.kv_b_proj.weight"] = torch.from_numpy(np.ascontiguousarray(joined))
        else:
            tensors[p + to_hf[rest]] = torch.from_numpy(values.copy())
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, dst / f.name)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst
