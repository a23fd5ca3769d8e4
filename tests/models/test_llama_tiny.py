"""Dense Llama family on tiny random configs, against transformers' own implementations.

Covers the family quirks: plain Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norm),
llama3 RoPE scaling, the GGUF q/k row permutation, prefill + cached decode equal to a full
forward, and a left-padded batch equal to single-sequence runs.
"""

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.load import build_from_tensors
from localmoe.models import family_for_model_type

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _tiny(model_type: str, **overrides):
    common = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    common.update(overrides)
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "qwen3": transformers.Qwen3Config}[model_type]
    if model_type == "qwen3":
        common.setdefault("head_dim", 16)
    config = config_class(**common)
    torch.manual_seed(0)
    reference = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make them matter
        for name, p in reference.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    return config, reference


def _ours(config, reference):
    family = family_for_model_type(config.model_type)
    spec = family.spec_from_hf(config.to_dict())
    tensors = dict(reference.state_dict())
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    return build_from_tensors(family, spec, tensors, family.hf_tensors, EngineConfig(dtype="float32"))


CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                   "original_max_position_embeddings": 32}}),
    "qwen2-bias": ("qwen2", {}),
    "qwen3-qknorm": ("qwen3", {}),
}


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request):
    model_type, overrides = CASES[request.param]
    config, reference = _tiny(model_type, **overrides)
    return reference, _ours(config, reference)


def _close(a, b, tol=1e-4):
    scale = b.abs().max().clamp(min=1e-6)
    assert (a - b).abs().max() / scale < tol, f"max rel diff {((a - b).abs().max() / scale).item():.2e}"


def test_full_forward_matches_transformers(pair):
    reference, ours = pair
    tokens = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = reference(tokens).logits
    _close(ours.forward(tokens, ours.new_cache(1, 64), all_logits=True), expected)


def test_prefill_then_decode_equals_full_forward(pair):
    _, ours = pair
    tokens = torch.randint(0, VOCAB, (1, 24), generator=torch.Generator().manual_seed(2))
    full = ours.forward(tokens, ours.new_cache(1, 64), all_logits=True)
    cache = ours.new_cache(1, 64)
    steps = [ours.forward(tokens[:, :16], cache, all_logits=True)]
    for t in range(16, 24):
        steps.append(ours.forward(tokens[:, t:t + 1], cache))
    _close(torch.cat(steps, dim=1), full, 1e-5)
    assert cache.offset == 24


def test_left_padded_batch_equals_single_runs(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(3)
    long, short = torch.randint(0, VOCAB, (20,), generator=g), torch.randint(0, VOCAB, (13,), generator=g)
    batch = torch.zeros(2, 20, dtype=torch.long)
    mask = torch.zeros(2, 20, dtype=torch.bool)
    batch[0], mask[0] = long, True
    batch[1, 7:], mask[1, 7:] = short, True
    cache = ours.new_cache(2, 64)
    first = ours.forward(batch, cache, mask=mask)
    nxt = torch.tensor([[5], [9]])
    second = ours.forward(nxt, cache)
    for row, seq in ((0, long), (1, short)):
        single = ours.new_cache(1, 64)
        a = ours.forward(seq[None], single)
        b = ours.forward(nxt[row:row + 1], single)
        _close(first[row], a[0], 1e-5)
        _close(second[row], b[0], 1e-5)


def _llama_cpp_permute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The row order llama.cpp's converter writes for q/k of `llama` GGUFs (rotate-adjacent-pairs RoPE)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_gguf_permuted_qk_are_restored():
    config, reference = _tiny("llama")
    family = family_for_model_type("llama")
    spec = family.spec_from_hf(config.to_dict())
    state = reference.state_dict()
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    gguf_named = {}
    for name, tensor in state.items():
        if name in names:
            gguf_named[names[name]] = tensor
            continue
        layer, rest = name.removeprefix("model.layers.").split(".", 1)
        part = rest.removesuffix(".weight")
        if part == "self_attn.q_proj":
            tensor = _llama_cpp_permute(tensor, spec.num_heads)
        elif part == "self_attn.k_proj":
            tensor = _llama_cpp_permute(tensor, spec.num_kv_heads)
        gguf_named[f"blk.{layer}.{parts[part]}.weight"] = tensor
    ours = build_from_tensors(family, spec, gguf_named, family.gguf_tensors("llama"), EngineConfig(dtype="float32"))
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(tokens).logits
    _close(ours.forward(tokens, ours.new_cache(1, 64), all_logits=True), expected)


def test_bf16_weights_stay_close_to_fp32():
    config, reference = _tiny("llama")
    family = family_for_model_type("llama")
    spec = family.spec_from_hf(config.to_dict())
    bf16 = build_from_tensors(family, spec, dict(reference.state_dict()), family.hf_tensors,
                              EngineConfig(dtype="bfloat16"))
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = reference(tokens).logits[:, -1:]
    cache = bf16.new_cache(1, 64)
    bf16.forward(tokens[:, :11], cache)
    _close(bf16.forward(tokens[:, 11:], cache), expected, 2e-2)  # decode step: the bf16 GEMV path


def test_decode_plan_steps_match_transformers(pair):
    """Single-sequence decode runs the whole layer stack in one kernel call (engine/decode_plan.py) for
    GQA + SiLU MLP layers, Qwen3's per-head q/k norms included; each step's logits against
    transformers' full forward."""
    from localmoe.engine.decode_plan import DecodePlan

    reference, ours = pair
    tokens = torch.randint(0, VOCAB, (1, 30), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        expected = reference(tokens).logits[:, 20:]
    cache = ours.new_cache(1, 64)
    ours.forward(tokens[:, :20], cache)
    ours._plan = None
    steps = [ours.forward(tokens[:, t:t + 1], cache) for t in range(20, 30)]
    _close(torch.cat(steps, dim=1), expected)
    assert isinstance(ours._plan, DecodePlan)
