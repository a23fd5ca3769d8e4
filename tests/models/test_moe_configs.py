"""MoE families: config.json -> ModelSpec (1-indexed layer lists, MoE placement) and the
routed-expert declarations, checked against the generated checkpoints in their real layouts."""

import json

import pytest

from localmoe.errors import CheckpointError, UnsupportedModelError
from localmoe.load import load_model
from localmoe.models import family_for_model_type
from localmoe.models.moe_config import kinds_from_one_indexed
from localmoe.store.safetensors import SafetensorsCheckpoint
from localmoe.testing import FAMILIES, write_checkpoint

MOE_FAMILIES = ["kimi_k3", "kimi_linear", "gpt_oss", "qwen3_next", "deepseek_v32", "glm5_next"]


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def checkpoint(request, tmp_path_factory):
    assert request.param in FAMILIES
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), size="tiny", seed=0)
    return request.param, path, json.loads((path / "config.json").read_text())


def test_spec_matches_the_config(checkpoint):
    _, _, config = checkpoint
    spec = family_for_model_type(config["model_type"]).spec_from_hf(config)
    text = config.get("text_config", config)
    assert spec.num_layers == text["num_hidden_layers"] and spec.hidden_size == text["hidden_size"]
    assert spec.num_experts == text.get("num_experts", text.get("num_local_experts", text.get("n_routed_experts")))
    assert spec.moe_layers(), "a MoE family must have MoE layers"
    if "linear_attn_config" in text and "kda_layers" in text["linear_attn_config"]:
        linear = text["linear_attn_config"]
        assert [i + 1 for i, k in enumerate(spec.layer_kinds) if k == "kda"] == linear["kda_layers"]
        assert [i + 1 for i, k in enumerate(spec.layer_kinds) if k == "mla"] == linear["full_attn_layers"]


def test_expert_declaration_finds_every_routed_expert(checkpoint):
    _, path, config = checkpoint
    family = family_for_model_type(config["model_type"])
    spec = family.spec_from_hf(config)
    names = set(SafetensorsCheckpoint(path).keys())
    matcher = family.experts.matcher()
    found = {n for n in names if matcher.match(n)}
    expected = set()
    for layer in spec.moe_layers():
        for expert in range(1 if family.experts.stacked else spec.num_experts):
            for projection in family.experts.patterns:
                expected |= set(family.experts.tensor_names(layer, expert, projection))
    assert found == expected
    assert not any("shared" in n for n in found)


def test_running_a_not_yet_runnable_family_is_a_clear_error(checkpoint):
    _, path, config = checkpoint
    if family_for_model_type(config["model_type"]).runnable:
        pytest.skip("runnable now: covered by tests/models/test_<family>.py")
    with pytest.raises(UnsupportedModelError, match="cannot run them yet"):
        load_model(path, progress=False)


def test_one_indexed_lists_are_checked():
    assert kinds_from_one_indexed(3, {"kda": [1, 2], "mla": [3]}, "c") == ("kda", "kda", "mla")
    with pytest.raises(CheckpointError, match="1-indexed"):
        kinds_from_one_indexed(3, {"kda": [0, 1, 2], "mla": [3]}, "c")
    with pytest.raises(CheckpointError, match="both"):
        kinds_from_one_indexed(2, {"kda": [1, 2], "mla": [2]}, "c")


def test_kda_and_mla_settings_survive_the_spec(checkpoint):
    """The Kimi families carry KDA/MLA settings through ModelSpec (and so through a store manifest)."""
    from localmoe.engine.layers import kda, mla
    from localmoe.engine.specs import spec_from_dict

    name, _, config = checkpoint
    if name not in ("kimi_linear", "kimi_k3"):
        pytest.skip("no KDA/MLA layers")
    parsed = family_for_model_type(config["model_type"]).spec_from_hf(config)
    spec = spec_from_dict(json.loads(json.dumps(parsed.to_dict())))
    text = config.get("text_config", config)
    assert spec == parsed
    assert spec.kda == kda.Config.from_hf(text, name) and spec.mla == mla.Config.from_hf(text)
    assert spec.kda.bounded_gate == spec.kda.full_rank_gate == (name == "kimi_k3")
    # cache per token: MLA latent + rope part only; KDA layers hold a constant state
    mla_layers = spec.layer_kinds.count("mla")
    assert spec.kv_bytes_per_token(4) == mla_layers * (text["kv_lora_rank"] + text["qk_rope_head_dim"]) * 4
