"""localmoe.testing: tiny random checkpoints load in transformers 5.23 with no missing or
unexpected keys and give finite logits; writes are deterministic; the tokenizers and chat
templates work; K3's layout is self-consistent; size plans hit their targets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from localmoe.errors import LocalMoEError
from localmoe.testing import FAMILIES, plan_checkpoint, write_checkpoint
from localmoe.testing.__main__ import main as cli_main
from localmoe.testing.plan import GB

HF_FAMILIES = ["kimi_linear", "gpt_oss", "qwen3_next", "qwen3_moe", "deepseek_v32", "deepseek_v3", "glm5_next"]  # transformers 5.23 has these


def _read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _text_config(config: dict) -> dict:
    return config.get("text_config", config)


def _load_hf(family: str, path: Path):
    import transformers

    kwargs = {}
    if family == "gpt_oss":  # on CPU without triton kernels MXFP4 loads dequantised
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    # transformers 5.23 has no Glm5NextForCausalLM: GLM-5-Next is image-text-to-text
    auto = transformers.AutoModelForImageTextToText if family == "glm5_next" else transformers.AutoModelForCausalLM
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # rope_scaling, as the real configs spell it
        return auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True, **kwargs)


@pytest.fixture(scope="module")
def hf_loaded(tmp_path_factory):
    """family -> (checkpoint dir, transformers model, loading info), each loaded once."""
    cache: dict[str, tuple] = {}

    def get(family: str):
        if family not in cache:
            path = write_checkpoint(family, tmp_path_factory.mktemp(family), "tiny", seed=0)
            model, info = _load_hf(family, path)
            cache[family] = (path, model.eval(), info)
        return cache[family]

    return get


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_tiny_loads_in_transformers_with_no_missing_or_unexpected_keys(hf_loaded, family):
    path, model, info = hf_loaded(family)
    assert list(info["missing_keys"]) == []
    assert list(info["unexpected_keys"]) == []
    assert list(info["mismatched_keys"]) == []
    assert list(info["error_msgs"]) == []
    vocab = _text_config(_read_config(path))["vocab_size"]
    with torch.no_grad():
        logits = model(torch.arange(8)[None] * 37 % vocab).logits
    assert logits.shape == (1, 8, vocab)
    assert torch.isfinite(logits).all()
    assert logits.std() > 1e-3  # random weights: not collapsed to a constant


def test_gpt_oss_mxfp4_matches_the_documented_decoding(hf_loaded):
    """blocks [E, 2I, D/32, 16] + scales [E, 2I, D/32]: element 2j in the low nibble,
    value = E2M1(code) * 2^(scale - 127); transformers holds gate_up_proj as [E, D, 2I]."""
    path, model, _ = hf_loaded("gpt_oss")
    e2m1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
    with safe_open(path / "model.safetensors", "pt") as f:
        blocks = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_blocks")
        scales = f.get_tensor("model.layers.1.mlp.experts.gate_up_proj_scales")
    codes = torch.stack([blocks & 15, blocks >> 4], dim=-1).flatten(-2).long()  # [E, 2I, D/32, 32]
    w = e2m1[codes] * torch.exp2(scales.float() - 127)[..., None]
    w = w.flatten(-2)  # [E, 2I, D]
    loaded = model.model.layers[1].mlp.experts.gate_up_proj.detach()
    torch.testing.assert_close(loaded, w.transpose(1, 2), rtol=0, atol=0)
    assert 1e-3 < w.abs()[w != 0].median() < 0.2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_writes_are_deterministic(tmp_path, family):
    a = write_checkpoint(family, tmp_path / "a", seed=3)
    b = write_checkpoint(family, tmp_path / "b", seed=3)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    c = write_checkpoint(family, tmp_path / "c", seed=4)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    assert (c / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tokenizer_and_chat_template(tmp_path, family):
    from transformers import AutoTokenizer

    from localmoe.tokenizer.hf import tokenizer_from_hf_dir

    path = write_checkpoint(family, tmp_path)
    config = _read_config(path)
    text = _text_config(config)
    tok = AutoTokenizer.from_pretrained(path)
    assert len(tok) <= text["vocab_size"]
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        ids = text.get(key)
        for i in [ids] if isinstance(ids, int) else ids or []:
            assert tok.added_tokens_decoder[i].special, (key, i)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital?"},
                {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Italy?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "What is the capital?" in prompt and "And of Italy?" in prompt
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert max(ids) < text["vocab_size"]
    assert tok.decode(tok.encode("Hello world, 42!", add_special_tokens=False)) == "Hello world, 42!"
    ours = tokenizer_from_hf_dir(path)  # localmoe's own reader sees the same template and tokens
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == prompt


def test_kimi_k3_special_tokens_and_xtml_template(tmp_path):
    from transformers import AutoTokenizer

    path = write_checkpoint("kimi_k3", tmp_path)
    tok = AutoTokenizer.from_pretrained(path)
    for t in ("<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>"):
        i = tok.convert_tokens_to_ids(t)
        assert tok.added_tokens_decoder[i].special and tok.added_tokens_decoder[i].content == t
        assert tok.encode(f"a{t}b", add_special_tokens=False)[1:-1] == [i]
    text = _read_config(path)["text_config"]
    assert tok.convert_ids_to_tokens(text["eos_token_id"]) == "<|end_of_msg|>"
    assert tok.convert_ids_to_tokens(text["pad_token_id"]) == "[PAD]" and text["pad_token_id"] == len(tok) - 1
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert prompt == ('<|open|>message role="system" type="thinking-effort"<|sep|>max<|close|>message<|sep|>'
                      '<|end_of_msg|><|open|>message role="user"<|sep|>hi<|close|>message<|sep|><|end_of_msg|>'
                      '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_kimi_k3_layer_lists_are_one_indexed_and_match_the_tensors():
    plan = plan_checkpoint("kimi_k3")
    text = plan.config["text_config"]
    L, lac = text["num_hidden_layers"], text["linear_attn_config"]
    kda, full = lac["kda_layers"], lac["full_attn_layers"]
    assert sorted(kda + full) == list(range(1, L + 1))  # a partition of 1..L
    assert kda and full and L % text["attn_res_block_size"] != 0 and L > 2 * text["attn_res_block_size"]
    names = {t.name: t for t in plan.tensors}
    H, K = lac["num_heads"], lac["head_dim"]
    for i in range(L):
        p = f"language_model.model.layers.{i}"
        is_kda = (i + 1) in kda
        assert (f"{p}.self_attn.A_log" in names) == is_kda
        assert (f"{p}.self_attn.q_a_proj.weight" in names) == (not is_kda)
        if is_kda:
            assert names[f"{p}.self_attn.A_log"].shape == (max(H, K),) and names[f"{p}.self_attn.A_log"].dtype == "F32"
            assert names[f"{p}.self_attn.g_proj.weight"].shape == (H * K, text["hidden_size"])  # full-rank gate
        else:
            assert names[f"{p}.self_attn.g_proj.weight"].shape == (text["num_attention_heads"] * text["v_head_dim"],
                                                                 text["hidden_size"])
        for res in ("self_attention_res", "mlp_res"):
            assert names[f"{p}.{res}_proj.weight"].shape == (1, text["hidden_size"])
            assert names[f"{p}.{res}_norm.weight"].shape == (text["hidden_size"],)
        assert (f"{p}.mlp.gate_proj.weight" in names) == (i < text["first_k_dense_replace"])
    assert "language_model.model.output_attn_res_proj.weight" in names
    assert "language_model.lm_head.weight" in names
    assert all(n.startswith("language_model.") for n in names)


def test_kimi_k3_every_routed_expert_is_mxfp4_packed():
    plan = plan_checkpoint("kimi_k3")
    text = plan.config["text_config"]
    Im, Lat, E = text["moe_intermediate_size"], text["routed_expert_hidden_size"], text["num_experts"]
    names = {t.name: t for t in plan.tensors}
    moe_layers = range(text["first_k_dense_replace"], text["num_hidden_layers"])
    want = {"w1": (Im, Lat), "w3": (Im, Lat), "w2": (Lat, Im)}
    for i in moe_layers:
        b = f"language_model.model.layers.{i}.block_sparse_moe"
        assert names[f"{b}.routed_expert_down_proj.weight"].shape == (Lat, text["hidden_size"])
        assert names[f"{b}.routed_expert_up_proj.weight"].shape == (text["hidden_size"], Lat)
        assert names[f"{b}.routed_expert_norm.weight"].shape == (Lat,)
        assert names[f"{b}.shared_experts.gate_proj.weight"].shape == (Im * text["num_shared_experts"],
                                                                        text["hidden_size"])
        for e in range(E):
            for w, (out_f, in_f) in want.items():
                packed, scale = names[f"{b}.experts.{e}.{w}.weight_packed"], names[f"{b}.experts.{e}.{w}.weight_scale"]
                assert (packed.dtype, packed.shape) == ("U8", (out_f, in_f // 2))
                assert (scale.dtype, scale.shape) == ("U8", (out_f, in_f // 32))
    experts = [t for t in plan.tensors if t.expert]
    assert len(experts) == len(moe_layers) * E * 6
    assert all(t.dtype == "BF16" or t.name.endswith(("A_log", "dt_bias", "e_score_correction_bias"))
               for t in plan.tensors if not t.expert)
    q = plan.config["quantization_config"]
    assert (q["quant_method"], q["format"]) == ("compressed-tensors", "mxfp4-pack-quantized")
    linears = {t.name.removesuffix(".weight") for t in plan.tensors if t.linear}
    assert set(q["ignore"]) == {n for n in linears if ".experts." not in n}


def test_kimi_k3_written_experts_decode_to_sane_weights(tmp_path):
    path = write_checkpoint("kimi_k3", tmp_path)
    with safe_open(path / "model.safetensors", "pt") as f:
        packed = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed")
        scale = f.get_tensor("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_scale")
    assert packed.dtype == torch.uint8 and scale.dtype == torch.uint8
    assert 118 <= int(scale.min()) and int(scale.max()) <= 124
    assert len(torch.unique(packed & 15)) == 16 and len(torch.unique(packed >> 4)) == 16


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_size_plans(family):
    small, large = plan_checkpoint(family, "small"), plan_checkpoint(family, "large")
    assert 100e6 <= small.params <= 300e6, small.params
    assert large.expert_bytes >= 8 * GB, large.expert_bytes
    assert 2 <= len(large.shards) and all(sum(t.nbytes for t in s) <= 2 * GB for s in large.shards)
    assert sorted(large.weight_map()) == sorted(t.name for t in large.tensors)


def test_sharded_write_has_a_consistent_index_and_loads(tmp_path):
    path = write_checkpoint("deepseek_v32", tmp_path, shard_bytes=200_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", s) for s in shards)
    total = 0
    for shard in shards:
        with safe_open(path / shard, "pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == shard}
            total += sum(f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys)
    assert total == index["metadata"]["total_size"]
    _, info = _load_hf("deepseek_v32", path)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # a later one-file write into the same directory leaves no stale shards behind
    write_checkpoint("deepseek_v32", path)
    assert sorted(p.name for p in path.glob("model*")) == ["model.safetensors"]


def test_unknown_family_or_size_is_a_user_error(tmp_path):
    with pytest.raises(LocalMoEError, match="kimi_k3"):
        write_checkpoint("kimi_k4", tmp_path)
    with pytest.raises(LocalMoEError, match="tiny, small, large"):
        plan_checkpoint("gpt_oss", "huge")
    assert not any(tmp_path.iterdir())


def test_cli_plan_and_write_match_the_api_across_processes(tmp_path, capsys):
    assert cli_main(["kimi_k3", "--size", "large", "--plan"]) == 0
    assert "GB of routed experts" in capsys.readouterr().out
    # another process (other hash seeds, fresh BPE training) writes the same bytes
    subprocess.run([sys.executable, "-m", "localmoe.testing", "kimi_k3", str(tmp_path / "cli"), "--seed", "5"],
                   check=True, capture_output=True, timeout=120)
    api = write_checkpoint("kimi_k3", tmp_path / "api", seed=5)
    files = sorted(p.name for p in api.iterdir())
    assert files == sorted(p.name for p in (tmp_path / "cli").iterdir())
    for name in files:
        assert (api / name).read_bytes() == (tmp_path / "cli" / name).read_bytes(), name
