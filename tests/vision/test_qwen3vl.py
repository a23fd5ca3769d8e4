"""The Qwen3-VL vision encoder (merger + deep-stack mergers) against transformers' Qwen3VLMoeVisionModel."""

import pytest
import torch

from localmoe.engine.layers import vision_qwen3vl

transformers = pytest.importorskip("transformers")
qcfg = pytest.importorskip("transformers.models.qwen3_vl_moe.configuration_qwen3_vl_moe")
qmod = pytest.importorskip("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe")

VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 48, "num_heads": 2, "patch_size": 4,
          "temporal_patch_size": 2, "spatial_merge_size": 2, "out_hidden_size": 24, "num_position_embeddings": 36,
          "deepstack_visual_indexes": [0, 2], "rope_parameters": {"rope_type": "axial", "rope_theta": 10000.0}}


def reference():
    torch.manual_seed(0)
    cfg = qcfg.Qwen3VLMoeVisionConfig(**VISION)
    cfg._attn_implementation = "eager"
    tower = qmod.Qwen3VLMoeVisionModel(cfg).eval()
    with torch.no_grad():  # non-trivial norms and biases
        for p in tower.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return cfg, tower, {"visual." + k: v for k, v in tower.state_dict().items()}


@pytest.mark.parametrize("grids", [[(6, 6)], [(4, 8), (2, 2)]], ids=["table-size", "resampled-two-images"])
def test_features_match_transformers(grids):
    cfg, tower, weights = reference()
    ours_cfg = vision_qwen3vl.Config.from_hf(cfg.to_dict())
    shapes = vision_qwen3vl.tensors(ours_cfg)
    assert shapes == {k: tuple(v.shape) for k, v in weights.items()}
    ours = vision_qwen3vl.build(ours_cfg, weights)
    n = sum(h * w for h, w in grids)
    patches = torch.randn(n, ours_cfg.patch_dim)
    with torch.no_grad():
        ref = tower(patches, grid_thw=torch.tensor([[1, h, w] for h, w in grids]))
    sizes = [h * w // 4 for h, w in grids]
    expected = [ref.pooler_output.split(sizes)] + [d.split(sizes) for d in ref.deepstack_features]
    got = ours(patches, grids)
    assert len(ref.deepstack_features) == 2
    for i, (emb, deep) in enumerate(got):
        for g, e in zip([emb, *deep], [exp[i] for exp in expected], strict=True):
            assert g.shape == e.shape
            assert (g - e).abs().max().item() <= 1e-5 * (e.max() - e.min()).item()
