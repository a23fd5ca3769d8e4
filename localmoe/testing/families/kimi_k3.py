"""Kimi K3 (`kimi_k3`, `KimiK3ForConditionalGeneration`; no transformers class).

The layout follows docs/MODELS.md and public conversion code; see
docs/testing-checkpoints.md for every name and shape and which of them are guesses.
Text weights sit under `language_model.` with Kimi-Linear's names where they coincide
(`block_sparse_moe`, `w1`/`w3`/`w2`, separate q/k/v convs, forget gate under `self_attn`)
plus K3's own: full-rank KDA gate `g_proj`, MLA output gate `g_proj`, latent MoE
(`routed_expert_down_proj` -> experts -> `routed_expert_norm` -> `routed_expert_up_proj`),
attention residuals (`self_attention_res_*`, `mlp_res_*`, `model.output_attn_res_*`).
Routed experts are compressed-tensors MXFP4 (`weight_packed` + `weight_scale`); the vision
tower of the released model is left out (text only).
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import kda, linear, mla, mxfp4_packed, norm, router, swiglu, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

# XTML: <|open|>TAG ATTRS<|sep|> ... <|close|>TAG<|sep|>, each message ended by <|end_of_msg|>.
_MSG_END = "<|close|>message<|sep|><|end_of_msg|>"
CHAT_TEMPLATE = "".join([
    "{%- set ns = namespace(calls=[], index=0) -%}",
    "{%- if tools -%}",
    '<|open|>message role="system" type="tool-declare"<|sep|>{{ tools | tojson }}', _MSG_END,
    "{%- endif -%}",
    '<|open|>message role="system" type="thinking-effort"<|sep|>{{ reasoning_effort | default("max", true) }}',
    _MSG_END,
    "{%- for m in messages -%}",
    "{%- if m['role'] == 'assistant' -%}",
    '<|open|>message role="assistant"<|sep|>',
    "<|open|>think<|sep|>{{ m.get('reasoning_content') or '' }}<|close|>think<|sep|>",
    "<|open|>response<|sep|>{{ m.get('content') or '' }}<|close|>response<|sep|>",
    "{%- if m.get('tool_calls') -%}",
    "{%- set ns.calls = [] -%}{%- set ns.index = 0 -%}",
    "<|open|>tools<|sep|>",
    "{%- for call in m['tool_calls'] -%}",
    "{%- set f = call['function'] if call.get('function') else call -%}",
    "{%- set ns.calls = ns.calls + [f['name']] -%}",
    '<|open|>call tool="{{ f[\'name\'] }}" index="{{ loop.index }}"<|sep|>',
    "{%- if f['arguments'] is mapping -%}",
    "{%- for key, value in f['arguments'].items() -%}",
    "{%- if value is string -%}",
    '<|open|>argument key="{{ key }}" type="string"<|sep|>{{ value }}<|close|>argument<|sep|>',
    "{%- else -%}",
    '<|open|>argument key="{{ key }}" type="json"<|sep|>{{ value | tojson }}<|close|>argument<|sep|>',
    "{%- endif -%}",
    "{%- endfor -%}",
    "{%- else -%}",
    '<|open|>arguments type="json"<|sep|>{{ f[\'arguments\'] }}<|close|>arguments<|sep|>',
    "{%- endif -%}",
    "<|close|>call<|sep|>",
    "{%- endfor -%}",
    "<|close|>tools<|sep|>",
    "{%- endif -%}",
    _MSG_END,
    "{%- elif m['role'] == 'tool' -%}",
    "{%- set ns.index = ns.index + 1 -%}",
    "{%- set name = m.get('name') or (ns.calls[ns.index - 1] if ns.index <= ns.calls | length else '') -%}",
    '<|open|>message role="tool" tool="{{ name }}" index="{{ ns.index }}"<|sep|>{{ m[\'content\'] }}', _MSG_END,
    "{%- else -%}",
    '<|open|>message role="{{ m[\'role\'] }}"<|sep|>{{ m[\'content\'] }}', _MSG_END,
    "{%- endif -%}",
    "{%- endfor -%}",
    '{%- if add_generation_prompt -%}<|open|>message role="assistant"<|sep|><|open|>think<|sep|>{%- endif -%}',
])

TOKENIZER = TokenizerLayout(
    tail=("[BOS]", "[EOS]", "<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>", "[PAD]"),
    chat_template=CHAT_TEMPLATE, bos="[BOS]", eos="<|end_of_msg|>", pad="[PAD]", stop=("[EOS]",))

_COMMON = {"conv": 4, "first_dense": 1, "shared": 2, "scaling": 1.0, "lower_bound": -5.0}
SIZES = {
    "tiny": dict(_COMMON, hidden=64, layers=7, full_attn_layers=[4, 7], block=3, heads=4, kda_heads=4, kda_dim=16,
                 q_lora=32, kv_lora=32, nope=16, rope=8, v=16, inter=128, moe_inter=64, latent=32, experts=16,
                 top_k=4),
    "small": dict(_COMMON, hidden=768, layers=8, full_attn_layers=[4, 8], block=4, heads=8, kda_heads=8, kda_dim=64,
                  q_lora=384, kv_lora=256, nope=64, rope=32, v=64, inter=2048, moe_inter=512, latent=384, experts=48,
                  top_k=8, vocab=32768),
    "large": dict(_COMMON, hidden=2048, layers=12, full_attn_layers=[4, 8, 12], block=4, heads=16, kda_heads=16,
                  kda_dim=128, q_lora=768, kv_lora=512, nope=128, rope=64, v=128, inter=8192, moe_inter=1024,
                  latent=1024, experts=512, top_k=16, vocab=32768),
}
PREFIX = "language_model."


def _res(prefix: str, hidden: int) -> list[TensorSpec]:
    """An attention-residual pseudo-query: RMSNorm weight [D] and Linear(D, 1) weight [1, D]."""
    return [*norm(f"{prefix}_res_norm", hidden), *linear(f"{prefix}_res_proj", 1, hidden, std=hidden ** -0.5)]


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"]
    H, K, Im, Lat = d["kda_heads"], d["kda_dim"], d["moe_inter"], d["latent"]
    full = set(d["full_attn_layers"])
    m = f"{PREFIX}model"
    t = [tensor(f"{m}.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"{m}.layers.{i}"
        t += _res(f"{p}.self_attention", D) + _res(f"{p}.mlp", D)
        t += norm(f"{p}.input_layernorm", D) + norm(f"{p}.post_attention_layernorm", D)
        if i + 1 in full:
            t += mla(f"{p}.self_attn", D, d["heads"], q_lora_rank=d["q_lora"], kv_lora_rank=d["kv_lora"],
                     qk_nope=d["nope"], qk_rope=d["rope"], v_dim=d["v"], output_gate=True)
        else:  # A_log is stored padded to the head dim; only the first H entries are live
            t += kda(f"{p}.self_attn", D, H, K, d["conv"], a_log_shape=(max(H, K),), full_rank_gate=True)
        if i < d["first_dense"]:
            t += swiglu(f"{p}.mlp", D, d["inter"])
        else:
            b = f"{p}.block_sparse_moe"
            t += router(f"{b}.gate", E, D) + linear(f"{b}.routed_expert_down_proj", Lat, D)
            for e in range(E):
                x = f"{b}.experts.{e}"
                t += mxfp4_packed(f"{x}.w1", Im, Lat) + mxfp4_packed(f"{x}.w2", Lat, Im) + mxfp4_packed(f"{x}.w3", Im, Lat)
            t += norm(f"{b}.routed_expert_norm", Lat) + linear(f"{b}.routed_expert_up_proj", D, Lat)
            t += swiglu(f"{b}.shared_experts", D, Im * d["shared"])
    t += norm(f"{m}.norm", D) + _res(f"{m}.output_attn", D) + linear(f"{PREFIX}lm_head", V, D)

    ignore = sorted(s.name.removesuffix(".weight") for s in t if s.linear and not s.expert)
    quantization = {
        "quant_method": "compressed-tensors",
        "format": "mxfp4-pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "format": "mxfp4-pack-quantized",
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "float", "symmetric": True, "strategy": "group", "group_size": 32,
                        "scale_dtype": "uint8", "dynamic": False, "actorder": None, "observer": "minmax"},
            "input_activations": None,
            "output_activations": None,
        }},
        "ignore": ignore,
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "global_compression_ratio": None,
    }
    text = {
        "model_type": "kimi_linear",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": d["inter"],
        "moe_intermediate_size": Im,
        "routed_expert_hidden_size": Lat,
        "latent_moe_use_norm": True,
        "num_hidden_layers": L,
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"],
        "q_lora_rank": d["q_lora"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "linear_attn_config": {
            "full_attn_layers": sorted(full),
            "kda_layers": [i for i in range(1, L + 1) if i not in full],
            "num_heads": H,
            "head_dim": K,
            "short_conv_kernel_size": d["conv"],
            "gate_lower_bound": d["lower_bound"],
            "use_full_rank_gate": True,
        },
        "attn_res_block_size": d["block"],
        "num_experts": E,
        "num_experts_per_token": d["top_k"],
        "num_shared_experts": d["shared"],
        "first_k_dense_replace": d["first_dense"],
        "moe_layer_freq": 1,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": True,
        "routed_scaling_factor": d["scaling"],
        "num_expert_group": 1,
        "topk_group": 1,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "num_nextn_predict_layers": 0,
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "model_max_length": 1048576,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": tok.id(tok.bos),
        "eos_token_id": tok.id(tok.eos),
        "pad_token_id": tok.id(tok.pad),
        "dtype": "bfloat16",
        "quantization_config": quantization,
    }
    config = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "bos_token_id": tok.id(tok.bos),
        "eos_token_id": tok.id(tok.eos),
        "pad_token_id": tok.id(tok.pad),
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
        "quantization_config": quantization,
    }
    return config, t


FAMILY = CheckpointGenerator("kimi_k3", build, SIZES, TOKENIZER)
