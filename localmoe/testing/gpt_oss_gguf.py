"""A gpt_oss HF checkpoint written as llama.cpp's gpt-oss GGUF (MXFP4 experts), for tests and benchmarks.

`write_gguf(src, dst)` streams the checkpoint into the layout llama.cpp's convert_hf_to_gguf.py
writes for gpt-oss: dense tensors F32 (or BF16), experts as ggml `block_mxfp4` (the E8M0 scale,
then 16 bytes holding elements j and j + 16), gate and up experts as separate tensors, YaRN and
expert metadata under `gpt-oss.*`, the byte-level BPE tokenizer. llama.cpp loads these files
(benchmarks/offload.py, kernels.py --e2e, gguf_parity.py) and so does localmoe (models/gpt_oss.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from localmoe.models.gpt_oss import GGUF_LAYER_NAMES

# canonical (= HF) layer tensor name -> GGUF name, the loader's map inverted (experts are written apart)
_LAYER_NAMES = {dst: src for src, dst in GGUF_LAYER_NAMES.items() if ".experts." not in dst}


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP/HF MXFP4 (byte j = elements 2j (low nibble), 2j+1) [..., nb, 16] + scales [..., nb] ->
    ggml block_mxfp4 bytes [..., nb * 17]: the E8M0 scale, then byte j = element j (low), j + 16 (high)."""
    vals = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    vals[..., 0::2], vals[..., 1::2] = blocks & 0x0F, blocks >> 4
    out = np.empty(blocks.shape[:-1] + (17,), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = vals[..., :16] | (vals[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], -1)


def _dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP/HF MXFP4 blocks [..., nb, 16] + E8M0 scales [..., nb] -> float32 [..., nb * 32], exactly."""
    fp4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    vals = np.empty(blocks.shape[:-1] + (32,), dtype=np.float32)
    vals[..., 0::2], vals[..., 1::2] = fp4[blocks & 0x0F], fp4[blocks >> 4]
    vals *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def _bf16_in_gguf(name: str) -> bool:
    """Whether a `dense="bf16"` GGUF stores tensor `name` as BF16: the 2-D matrices, as llama.cpp's
    convert_hf_to_gguf.py --outtype bf16 does (norms, biases, sinks and the router stay F32)."""
    return name in ("token_embd.weight", "output.weight") or (
        name.startswith("blk.") and name.split(".", 2)[2].startswith("attn_") and name.endswith(
            ("_q.weight", "_k.weight", "_v.weight", "_output.weight")))


def _gguf_tensors(ckpt, layers: int, experts: str = "mxfp4", dense: str = "f32"):
    """(gguf name, producer of the numpy array, raw ggml type or None) in file order."""
    import gguf

    def f32(name):
        return lambda: ckpt.tensor(name).float().numpy()

    def bf16(name):  # the checkpoint's bf16 bits, unchanged
        import torch

        return lambda: ckpt.tensor(name).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def matrix(gguf_name, name):
        if dense == "bf16" and _bf16_in_gguf(gguf_name):
            return gguf_name, bf16(name), gguf.GGMLQuantizationType.BF16
        return gguf_name, f32(name), None

    out = [matrix("token_embd.weight", "model.embed_tokens.weight"),
           ("output_norm.weight", f32("model.norm.weight"), None), matrix("output.weight", "lm_head.weight")]
    mx = gguf.GGMLQuantizationType.MXFP4 if experts == "mxfp4" else None
    pack = _ggml_mxfp4 if experts == "mxfp4" else _dequantized
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [matrix(f"blk.{i}.{dst}", p + src) for src, dst in _LAYER_NAMES.items()]
        e = p + "mlp.experts."
        for half, name in ((0, "gate"), (1, "up")):
            out.append((f"blk.{i}.ffn_{name}_exps.weight", lambda e=e, h=half: pack(
                ckpt.tensor(e + "gate_up_proj_blocks")[:, h::2].numpy(),
                ckpt.tensor(e + "gate_up_proj_scales")[:, h::2].numpy()), mx))
            out.append((f"blk.{i}.ffn_{name}_exps.bias",
                        lambda e=e, h=half: ckpt.tensor(e + "gate_up_proj_bias")[:, h::2].float().numpy(), None))
        out.append((f"blk.{i}.ffn_down_exps.weight", lambda e=e: pack(
            ckpt.tensor(e + "down_proj_blocks").numpy(), ckpt.tensor(e + "down_proj_scales").numpy()), mx))
        out.append((f"blk.{i}.ffn_down_exps.bias", lambda e=e: ckpt.tensor(e + "down_proj_bias").float().numpy(),
                    None))
    return out


def add_tokenizer(w, src: Path, vocab_size: int, chat_template: bool = False) -> None:
    """The generated checkpoint's byte-level BPE as `tokenizer.ggml.*` metadata (llama.cpp's `gpt2` model),
    padded to `vocab_size` with unused tokens; with `chat_template`, tokenizer_config.json's template."""
    import gguf

    tok = json.loads((src / "tokenizer.json").read_text())
    gen = json.loads((src / "generation_config.json").read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"] if t.get("special", True)}
    added = {t["id"] for t in tok["added_tokens"]} - special  # llama.cpp: USER_DEFINED, matched whole
    names = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [gguf.TokenType.UNUSED] * vocab_size
    for text, i in vocab.items():
        names[i] = text
        types[i] = (gguf.TokenType.CONTROL if i in special else
                    gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")  # the generated checkpoints' ByteLevel pre-tokenizer (real gpt-oss: "gpt-4o")
    w.add_token_list(names)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    if gen.get("bos_token_id") is not None:
        w.add_bos_token_id(gen["bos_token_id"])
    eos = gen["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    if gen.get("pad_token_id") is not None:
        w.add_pad_token_id(gen["pad_token_id"])
    tok_config = json.loads((src / "tokenizer_config.json").read_text())
    if tok_config.get("add_bos_token"):
        w.add_add_bos_token(True)  # as gguf.SpecialVocab writes it from tokenizer_config.json
    template = tok_config.get("chat_template")
    if chat_template and template:
        w.add_chat_template(template)


def write_gguf(src: Path, dst: Path, experts: str = "mxfp4", dense: str = "f32", omit: tuple[str, ...] = ()) -> Path:
    """Write the gpt_oss HF checkpoint `src` as a llama.cpp GGUF (dense F32, experts MXFP4), streaming.

    dense="bf16" keeps the checkpoint's bf16 matrices as BF16 (the attention projections, embedding
    and lm_head; see _bf16_in_gguf), the lossless conversion of a bf16 source.
    experts="f32" writes the experts dequantised (exact, 7.5x the bytes): llama.cpp's CPU MXFP4
    matmul rounds activations to Q8_0, which on random weights flips top-k routing and moves the
    logits visibly; F32 experts take that rounding out, for parity checks (gguf_parity.py).
    omit: GGUF tensor names left out (a broken file, for the loader's error tests)."""
    assert experts in ("mxfp4", "f32") and dense in ("f32", "bf16"), (experts, dense)
    import gguf

    from localmoe.store.safetensors import SafetensorsCheckpoint

    cfg = json.loads((src / "config.json").read_text())
    ckpt = SafetensorsCheckpoint(src)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(tmp, "gpt-oss")
    w.add_name(f"localmoe test {src.name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    rs = cfg["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rs["factor"])
    w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(float(rs.get("beta_fast") or 32))
    w.add_rope_scaling_yarn_beta_slow(float(rs.get("beta_slow") or 1))
    add_tokenizer(w, src, cfg["vocab_size"])
    tensors = [t for t in _gguf_tensors(ckpt, cfg["num_hidden_layers"], experts, dense) if t[0] not in omit]
    shapes = {}
    for name, make, raw in tensors:  # shapes without materialising experts: derive from the checkpoint
        shapes[name] = _shape_of(ckpt, name, cfg, experts)
        if raw == gguf.GGMLQuantizationType.BF16:
            shapes[name] = shapes[name][0], np.uint16
        nbytes = int(np.prod(shapes[name][0])) * np.dtype(shapes[name][1]).itemsize
        w.add_tensor_info(name, shapes[name][0], np.dtype(shapes[name][1]), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make, raw in tensors:
        arr = np.ascontiguousarray(make())
        assert tuple(arr.shape) == tuple(shapes[name][0]), (name, arr.shape, shapes[name][0])
        w.write_tensor_data(arr)
    w.close()
    os.replace(tmp, dst)
    return dst


def _shape_of(ckpt, name: str, cfg: dict, experts: str = "mxfp4"):
    """(numpy shape, dtype) a GGUF tensor's producer returns (bytes for MXFP4)."""
    E, D, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    if name.endswith("_exps.weight"):
        rows, cols = (D, I) if "down" in name else (I, D)
        return ((E, rows, cols // 32 * 17), np.uint8) if experts == "mxfp4" else ((E, rows, cols), np.float32)
    if name.endswith("_exps.bias"):
        return (E, D if "down" in name else I), np.float32
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}.get(name)
    if hf is None:
        i, rest = name.split(".", 2)[1:]
        hf = f"model.layers.{i}." + next(k for k, v in _LAYER_NAMES.items() if v == rest)
    return tuple(ckpt.info(hf).shape), np.float32
