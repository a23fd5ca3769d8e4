"""A real-weight MoE to page: the embedded SmolLM2-135M-Instruct written as a GLM-4.5-style MoE checkpoint
whose routed experts are all copies of the layer's own MLP (for benchmarks/spec.py).

A random-weight store never quotes its prompt, so prompt lookup is never right on it and speculation on a
paged store cannot be measured with real acceptance there. This checkpoint computes what SmolLM2 computes
(the same answers, quotes included) while its decode pays a real MoE's expert traffic:
- every layer's MLP becomes `experts` routed experts, each an exact copy of it, top-`top_k` chosen by a
  sigmoid router with random weights (seeded) over the post-attention hidden state; the chosen weights
  are renormalised to sum to 1 (`norm_topk_prob`, routed scaling 1, no shared expert), so the block's
  output is the MLP's output (up to the rounding of w1 * y + w2 * y);
- attention as GLM-4.5-Air's without biases, q/k norms or partial RoPE (`partial_rotary_factor` 1): Llama's;
- the tokenizer and chat template are the GGUF's (tokenizer.json written from localmoe's reading of it).
The routing is arbitrary (any choice gives the same output) and follows the hidden state the way a
router does; real routers' choices between neighbouring tokens may overlap more or less than these.
The weights are the GGUF's Q4_1 / Q8_0 values dequantised (`gguf.quants`), written in bf16; `convert`
then stores the experts as MXFP4 (a second 4-bit rounding: the store's answers may part from the
embedded model's at near-ties, which the benchmark reports, not hides).
"""

from __future__ import annotations

import json
from pathlib import Path


def write_upcycled(dst: Path, experts: int = 8, top_k: int = 2, seed: int = 0) -> Path:
    import gguf
    import torch
    from safetensors.torch import save_file

    from localmoe.checkpoint import open_checkpoint
    from localmoe.default_model import default_model_path

    src = default_model_path()
    ckpt = open_checkpoint(src)
    spec, names = ckpt.spec, ckpt.tensor_map
    reader = gguf.GGUFReader(str(src))
    canonical: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        resolved = names.resolve(t.name)
        if resolved is None:
            continue
        name, transform = resolved
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).float()
        canonical[name] = transform(values, spec) if transform else values
    gen = torch.Generator().manual_seed(seed)
    D, L = spec.hidden_size, spec.num_layers
    out: dict[str, torch.Tensor] = {}
    for name, value in canonical.items():
        if not name.startswith("layers."):
            out["lm_head.weight" if name == "lm_head.weight" else f"model.{name}"] = value
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("mlp."):
            proj = rest.split(".")[1]  # gate_proj / up_proj / down_proj
            for e in range(experts):
                out[f"model.layers.{i}.mlp.experts.{e}.{proj}.weight"] = value
        else:
            out[f"model.layers.{i}.{rest}"] = value
    for i in range(L):
        out[f"model.layers.{i}.mlp.gate.weight"] = torch.randn(experts, D, generator=gen) / D ** 0.5
        out[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.zeros(experts)
    dst.mkdir(parents=True, exist_ok=True)
    # safetensors refuses shared storage: each expert its own copy
    save_file({n: v.to(torch.bfloat16).contiguous().clone() for n, v in out.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "_name_or_path": "SmolLM2-135M-Instruct upcycled (experts = copies of the MLP)",
        "vocab_size": spec.vocab_size, "hidden_size": D, "num_hidden_layers": L,
        "num_attention_heads": spec.num_heads, "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim,
        "intermediate_size": spec.intermediate_size, "moe_intermediate_size": spec.intermediate_size,
        "n_routed_experts": experts, "num_experts_per_tok": top_k, "n_shared_experts": 0,
        "first_k_dense_replace": 0, "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "n_group": 1, "topk_group": 1, "partial_rotary_factor": 1.0, "attention_bias": False,
        "use_qk_norm": False, "rms_norm_eps": spec.rms_norm_eps, "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.max_position_embeddings, "tie_word_embeddings": "lm_head.weight" not in out,
        "hidden_act": "silu", "torch_dtype": "bfloat16", "num_nextn_predict_layers": 0,
    }
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    tok = ckpt.tokenizer()
    tok.backend.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {**tok.special_tokens, "chat_template": tok.chat_template}, indent=1))
    stops = sorted(tok.stop_token_ids)
    (dst / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tok.bos_token_id, "eos_token_id": stops}, indent=1))
    return dst
