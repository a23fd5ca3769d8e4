"""Dense Llama family: Llama 2/3, Mistral, SmolLM2, Qwen2 and Qwen3 dense.

Quirks, each covered by a test:
- GGUF `llama` files store q_proj/k_proj rows permuted for GPT-J style RoPE; we undo it
  so one (NeoX style) RoPE serves every checkpoint. `qwen2`/`qwen3` GGUFs are not permuted.
- Qwen2 has biases on q/k/v; Qwen3 RMS-normalises q and k per head before RoPE.
- A missing `lm_head` / `output.weight` means the embedding is tied.
"""

from __future__ import annotations

import torch

from localmoe.config import ModelSpec
from localmoe.engine.layers.attention import GQA_TENSORS, gqa_fields_from_hf
from localmoe.models import register
from localmoe.models.base import ModelFamily, TensorMap, TensorRule, hf_rules


def spec_from_hf(config: dict) -> ModelSpec:
    model_type = config["model_type"]
    attention = gqa_fields_from_hf(config, model_type)
    return ModelSpec(
        model_type=model_type,
        family="llama",
        vocab_size=config["vocab_size"],
        hidden_size=config["hidden_size"],
        num_layers=config["num_hidden_layers"],
        intermediate_size=config["intermediate_size"],
        rms_norm_eps=config.get("rms_norm_eps", 1e-6),
        max_position_embeddings=config.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        hidden_act=config.get("hidden_act", "silu"),
        name=config.get("_name_or_path", ""),
        **attention,
    )


def spec_from_gguf(metadata: dict, tensor_names: set) -> ModelSpec:
    arch = metadata["general.architecture"]

    def key(name: str, default=None):
        value = metadata.get(f"{arch}.{name}", default)
        if value is None:
            from localmoe.errors import CheckpointError

            raise CheckpointError(f"GGUF metadata lacks {arch}.{name}")
        return value

    heads = key("attention.head_count")
    kv_heads = key("attention.head_count_kv", heads)
    hidden = key("embedding_length")
    scaling = None
    if metadata.get(f"{arch}.rope.scaling.type") not in (None, "none"):
        scaling = {"rope_type": metadata[f"{arch}.rope.scaling.type"],
                   "factor": metadata.get(f"{arch}.rope.scaling.factor", 1.0),
                   "original_max_position_embeddings":
                       metadata.get(f"{arch}.rope.scaling.original_context_length", 4096)}
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens", ()))
    return ModelSpec(
        model_type=arch,
        family="llama",
        vocab_size=vocab,
        hidden_size=hidden,
        num_layers=key("block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=key("attention.key_length", hidden // heads),
        intermediate_size=key("feed_forward_length"),
        rms_norm_eps=key("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=key("rope.freq_base", 10000.0),
        rope_scaling=scaling,
        max_position_embeddings=key("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        qk_norm="blk.0.attn_q_norm.weight" in tensor_names,
        name=metadata.get("general.name", ""),
    )


def _unpermute(heads_of) -> callable:
    """Undo llama.cpp's q/k row permutation (rows stored as [H, D/2, 2], NeoX wants [H, 2, D/2])."""

    def transform(w: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
        heads = heads_of(spec)
        rows = w.shape[0]
        return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    return transform


_unpermute_q = _unpermute(lambda s: s.num_heads)
_unpermute_k = _unpermute(lambda s: s.num_kv_heads)

HF_TENSORS = TensorMap(
    rules=hf_rules(("input_layernorm.weight", "post_attention_layernorm.weight", *(f"self_attn.{t}" for t in GQA_TENSORS),
                    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")),
    ignore=(r"rotary_emb\.inv_freq$",),
)


def gguf_tensors(architecture: str) -> TensorMap:
    permuted = architecture == "llama"  # llama.cpp permutes q/k only for LLAMA-style rope
    q_fix, k_fix = (_unpermute_q, _unpermute_k) if permuted else (None, None)
    layer = [
        ("attn_norm.weight", "input_layernorm.weight", None),
        ("ffn_norm.weight", "post_attention_layernorm.weight", None),
        ("attn_q.weight", "self_attn.q_proj.weight", q_fix),
        ("attn_k.weight", "self_attn.k_proj.weight", k_fix),
        ("attn_v.weight", "self_attn.v_proj.weight", None),
        ("attn_q.bias", "self_attn.q_proj.bias", q_fix),
        ("attn_k.bias", "self_attn.k_proj.bias", k_fix),
        ("attn_v.bias", "self_attn.v_proj.bias", None),
        ("attn_output.weight", "self_attn.o_proj.weight", None),
        ("attn_q_norm.weight", "self_attn.q_norm.weight", None),
        ("attn_k_norm.weight", "self_attn.k_norm.weight", None),
        ("ffn_gate.weight", "mlp.gate_proj.weight", None),
        ("ffn_up.weight", "mlp.up_proj.weight", None),
        ("ffn_down.weight", "mlp.down_proj.weight", None),
    ]
    return TensorMap(
        rules=(
            TensorRule("token_embd.weight", "embed_tokens.weight"),
            TensorRule("output_norm.weight", "norm.weight"),
            TensorRule("output.weight", "lm_head.weight"),
            TensorRule("rope_freqs.weight", "rope_freqs.weight"),
            *(TensorRule(f"blk.{{i}}.{src}", f"layers.{{i}}.{dst}", fix) for src, dst, fix in layer),
        ),
    )


FAMILY = register(ModelFamily(
    name="llama",
    model_types=("llama", "mistral", "qwen2", "qwen3", "smollm"),
    gguf_architectures=("llama", "qwen2", "qwen3"),
    spec_from_hf=spec_from_hf,
    spec_from_gguf=spec_from_gguf,
    hf_tensors=HF_TENSORS,
    gguf_tensors=gguf_tensors,
    optional_tensors=(r"^lm_head\.weight$", r"^rope_freqs\.weight$"),
))
