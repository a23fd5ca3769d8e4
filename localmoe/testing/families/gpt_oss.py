"""gpt-oss (`gpt_oss`, transformers `GptOssForCausalLM`), as OpenAI ships it.

Experts are stacked per layer in MXFP4: `mlp.experts.gate_up_proj_blocks` U8
[E, 2I, D/32, 16] + `_scales` U8 [E, 2I, D/32] + `gate_up_proj_bias` bf16 [E, 2I], rows
interleaved (gate = even rows, up = odd rows); `down_proj_blocks` [E, D, I/32, 16] +
`_scales` [E, D, I/32] + `down_proj_bias` [E, D]. Each byte holds two E2M1 codes, element
2j in the low nibble; value = code * 2^(scale - 127). Attention: GQA with biases and
per-head `sinks`, alternating sliding-window / full layers, YaRN RoPE.
"""

from __future__ import annotations

from typing import Any

from localmoe.testing.layers import MXFP4_CODES, MXFP4_SCALE, U8, linear, norm, tensor
from localmoe.testing.plan import CheckpointGenerator, TensorSpec
from localmoe.testing.random_data import normal
from localmoe.testing.tokenizer import TokenizerLayout

# The harmony format, cut down: developer instructions, user turns, final-channel replies.
CHAT_TEMPLATE = """\
<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ reasoning_effort | default('medium') }}

# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>
{%- for message in messages -%}
{%- if message['role'] in ('system', 'developer') -%}
<|start|>developer<|message|># Instructions

{{ message['content'] }}<|end|>
{%- elif message['role'] == 'user' -%}
<|start|>user<|message|>{{ message['content'] }}<|end|>
{%- elif message['role'] == 'assistant' -%}
{%- if message.get('thinking') -%}
<|start|>assistant<|channel|>analysis<|message|>{{ message['thinking'] }}<|end|>
{%- endif -%}
<|start|>assistant<|channel|>final<|message|>{{ message['content'] }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""

TOKENIZER = TokenizerLayout(
    tail=("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
          "<|message|>", "<|call|>"),
    chat_template=CHAT_TEMPLATE, bos="<|startoftext|>", eos="<|return|>", pad="<|endoftext|>",
    stop=("<|endoftext|>", "<|call|>"), template_file=True)

QUANTIZATION_CONFIG = {
    "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                               "lm_head"],
    "quant_method": "mxfp4",
}

SIZES = {
    "tiny": {"hidden": 64, "layers": 4, "heads": 4, "kv_heads": 2, "head_dim": 16, "inter": 64, "experts": 8,
             "top_k": 2, "window": 4},
    "small": {"hidden": 768, "layers": 8, "heads": 12, "kv_heads": 4, "head_dim": 64, "inter": 768, "experts": 16,
              "top_k": 4, "window": 128, "vocab": 32768},
    "large": {"hidden": 2048, "layers": 12, "heads": 32, "kv_heads": 8, "head_dim": 64, "inter": 2048, "experts": 128,
              "top_k": 4, "window": 128, "vocab": 32768},
}


def _mxfp4_stack(name: str, experts: int, rows: int, cols: int) -> list[TensorSpec]:
    if cols % 32:
        raise ValueError(f"{name}: MXFP4 input width {cols} is not a multiple of 32")
    return [tensor(f"{name}_blocks", (experts, rows, cols // 32, 16), MXFP4_CODES, U8, expert=True,
                   params_per_element=2),
            tensor(f"{name}_scales", (experts, rows, cols // 32), MXFP4_SCALE, U8, expert=True, params_per_element=0),
            tensor(f"{name}_bias", (experts, rows), normal(0.02), expert=True)]


def build(d: dict[str, Any], tok: TokenizerLayout) -> tuple[dict[str, Any], list[TensorSpec]]:
    D, L, V, E, I = d["hidden"], d["layers"], d.get("vocab", tok.vocab_size), d["experts"], d["inter"]
    Hq, Hkv, hd = d["heads"], d["kv_heads"], d["head_dim"]
    t = [tensor("model.embed_tokens.weight", (V, D), normal())]
    for i in range(L):
        p = f"model.layers.{i}"
        t += norm(f"{p}.input_layernorm", D) + norm(f"{p}.post_attention_layernorm", D)
        a = f"{p}.self_attn"
        t += [*linear(f"{a}.q_proj", Hq * hd, D, bias=True), *linear(f"{a}.k_proj", Hkv * hd, D, bias=True),
              *linear(f"{a}.v_proj", Hkv * hd, D, bias=True), *linear(f"{a}.o_proj", D, Hq * hd, bias=True),
              tensor(f"{a}.sinks", (Hq,), normal(0.5))]
        t += linear(f"{p}.mlp.router", E, D, bias=True)
        t += _mxfp4_stack(f"{p}.mlp.experts.gate_up_proj", E, 2 * I, D)
        t += _mxfp4_stack(f"{p}.mlp.experts.down_proj", E, D, I)
    t += norm("model.norm", D) + linear("lm_head", V, D)

    config = {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": V,
        "hidden_size": D,
        "intermediate_size": I,
        "num_hidden_layers": L,
        "num_attention_heads": Hq,
        "num_key_value_heads": Hkv,
        "head_dim": hd,
        "attention_bias": True,
        "attention_dropout": 0.0,
        "sliding_window": d["window"],
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(L)],
        "num_local_experts": E,
        "num_experts_per_tok": d["top_k"],
        "experts_per_token": d["top_k"],
        "router_aux_loss_coef": 0.9,
        "output_router_logits": False,
        "swiglu_limit": 7.0,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "initial_context_length": 4096,
        "max_position_embeddings": 131072,
        "rope_theta": 150000,
        "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                         "rope_type": "yarn", "truncate": False},
        "tie_word_embeddings": False,
        "use_cache": True,
        "eos_token_id": tok.id(tok.eos),
        "pad_token_id": tok.id(tok.pad),
        "quantization_config": QUANTIZATION_CONFIG,
    }
    return config, t


FAMILY = CheckpointGenerator("gpt_oss", build, SIZES, TOKENIZER)
