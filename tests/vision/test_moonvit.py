"""The MoonViT tower + projector against transformers' Kimi_K25VisionModel + Kimi_K25MultimodalProjection."""

import pytest
import torch

from localmoe.engine.layers import vision_moonvit
from localmoe.testing.vision import moonvit_released_layout

transformers = pytest.importorskip("transformers")
k25 = pytest.importorskip("transformers.models.kimi_k25.configuration_kimi_k25")

VISION = {"patch_size": 14, "pos_emb_height": 8, "pos_emb_width": 8, "pos_emb_time": 4, "num_attention_heads": 2,
              "num_hidden_layers": 2, "hidden_size": 32, "intermediate_size": 48, "merge_kernel_size": [2, 2],
              "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}
TEXT_HIDDEN = 24


def reference():
    torch.manual_seed(0)
    cfg = k25.Kimi_K25Config(vision_config=VISION, text_config={"model_type": "deepseek_v3", "hidden_size": TEXT_HIDDEN},
                             projection_hidden_size=VISION["hidden_size"])
    cfg.vision_config._attn_implementation = "eager"
    tower = transformers.Kimi_K25VisionModel(cfg.vision_config).eval()
    proj = transformers.models.kimi_k25.modeling_kimi_k25.Kimi_K25MultimodalProjection(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in [*tower.parameters(), *proj.parameters()]:
            p.add_(torch.randn_like(p) * 0.1)
    return cfg, tower, proj, moonvit_released_layout(tower.state_dict(), proj.state_dict(), VISION["num_attention_heads"])


@pytest.mark.parametrize("grids", [[(8, 8)], [(6, 10), (4, 2)]], ids=["table-size", "resampled-two-images"])
def test_features_match_transformers(grids):
    cfg, tower, proj, weights = reference()
    ours_cfg = vision_moonvit.Config.from_hf(cfg.vision_config.to_dict(), TEXT_HIDDEN, cfg.projection_layer_norm_eps)
    shapes = vision_moonvit.tensors(ours_cfg)
    assert shapes == {k: tuple(v.shape) for k, v in weights.items() if k in shapes}
    assert set(shapes) == set(weights)
    ours = vision_moonvit.build(ours_cfg, weights)
    n = sum(h * w for h, w in grids)
    patches = torch.randn(n, 3, 14, 14)
    grid_thw = torch.tensor([[1, h, w] for h, w in grids])
    with torch.no_grad():
        pooled = tower(patches, grid_thw=grid_thw).pooler_output
        expected = proj(pooled).squeeze(1).split([h * w // 4 for h, w in grids])
    got = ours(patches, grids)
    for g, e in zip(got, expected, strict=True):
        assert g.shape == e.shape
        span = (e.max() - e.min()).item()
        assert (g - e).abs().max().item() <= 1e-5 * span


def test_bad_grid_is_named():
    cfg, _, _, weights = reference()
    ours = vision_moonvit.build(vision_moonvit.Config.from_hf(cfg.vision_config.to_dict(), TEXT_HIDDEN), weights)
    with pytest.raises(ValueError, match="merge kernel"):
        ours(torch.randn(9, 3, 14, 14), [(3, 3)])
    with pytest.raises(ValueError, match="grid"):
        ours(torch.randn(5, 3, 14, 14), [(2, 2)])
