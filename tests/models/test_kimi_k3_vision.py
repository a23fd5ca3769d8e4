"""Kimi K3 with a `vision_config`: the tiny K3 checkpoint plus a MoonViT tower written by transformers'
modules (Kimi_K25VisionModel + Kimi_K25MultimodalProjection, in the released layout): the tower's features
match those modules, and image embeddings land on the placeholder positions (a prompt whose "image" is
some tokens' own embedding rows gives exactly those tokens' logits)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from localmoe.testing import write_checkpoint
from localmoe.testing.parity import load_ours, max_diff, random_tokens
from localmoe.testing.vision import moonvit_released_layout

transformers = pytest.importorskip("transformers")
k25 = pytest.importorskip("transformers.models.kimi_k25.configuration_kimi_k25")

PLACEHOLDER = 600
VISION = {"patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4, "num_attention_heads": 2,
          "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48, "merge_kernel_size": [2, 2],
          "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}


@pytest.fixture(scope="module")
def k3_with_tower(tmp_path_factory):
    path = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3v"), "tiny", seed=0)
    config = json.loads((path / "config.json").read_text())
    hidden = config["text_config"]["hidden_size"]
    cfg = k25.Kimi_K25Config(vision_config=VISION, text_config={"model_type": "deepseek_v3", "hidden_size": hidden},
                             projection_hidden_size=VISION["hidden_size"])
    torch.manual_seed(0)
    tower = transformers.Kimi_K25VisionModel(cfg.vision_config).eval()
    proj = transformers.models.kimi_k25.modeling_kimi_k25.Kimi_K25MultimodalProjection(cfg).eval()
    with torch.no_grad():
        for p in [*tower.parameters(), *proj.parameters()]:
            p.add_(torch.randn_like(p) * 0.1)
    weights = moonvit_released_layout(tower.state_dict(), proj.state_dict(), VISION["num_attention_heads"])
    text = load_file(path / "model.safetensors")
    save_file(text | {k: v.to(torch.bfloat16).contiguous() for k, v in weights.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    config["vision_config"] = VISION
    config["media_placeholder_token_id"] = PLACEHOLDER
    (path / "config.json").write_text(json.dumps(config))
    with torch.no_grad():  # the reference with the stored (bf16-rounded) weights
        for m in (tower, proj):
            for p in m.parameters():
                p.copy_(p.to(torch.bfloat16).float())
    return load_ours(path), tower, proj


def test_k3_tower_matches_transformers_modules(k3_with_tower):
    ours, tower, proj = k3_with_tower
    assert ours.spec.vision.num_layers == 2 and ours.spec.image_token_id == PLACEHOLDER
    torch.manual_seed(2)
    patches = torch.randn(6 * 4, 3, 14, 14)
    with torch.no_grad():
        expected = proj(tower(patches, grid_thw=torch.tensor([[1, 6, 4]])).pooler_output).squeeze(1)
    got = ours.model.vision(patches, [(6, 4)])[0]
    assert got.shape == (6, ours.spec.hidden_size)
    assert max_diff(got, expected)[0] <= 1e-5 * (expected.max() - expected.min()).item()


def test_image_rows_land_on_the_placeholders(k3_with_tower):
    ours = k3_with_tower[0]
    tokens = random_tokens(16, 4, 590)
    stand_ins = tokens[0, 5:9]
    embed = ours.model.embed if isinstance(ours.model.embed, torch.Tensor) else None
    assert embed is not None
    with_placeholders = tokens.clone()
    with_placeholders[0, 5:9] = PLACEHOLDER
    want = ours.model.forward(tokens, ours.model.new_cache(1, 16), all_logits=True)
    got = ours.model.forward(with_placeholders, ours.model.new_cache(1, 16), all_logits=True,
                             image_embeds=embed[stand_ins])
    assert torch.equal(got, want)
