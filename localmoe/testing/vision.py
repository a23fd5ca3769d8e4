"""The MoonViT tower of transformers' modules (`Kimi_K25VisionModel` + `Kimi_K25MultimodalProjection`
state dicts) in the released checkpoint layout (fused `wqkv` with interleaved rotary pairs, `norm0/1`,
`mlp.fc0/1`, `mm_projector.proj.0/2`): what tests put beside a text checkpoint to give it a tower."""

from __future__ import annotations

import torch


def interleave_rotary_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Half-split rotary rows (transformers) back to the released interleaved pairs: row a * hd/2 + r -> 2r + a."""
    half = w.shape[0] // heads // 2
    return w.reshape(heads, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def moonvit_released_layout(tower: dict, projector: dict, heads: int, prefix: str = "vision_tower.",
                            proj_prefix: str = "mm_projector.") -> dict[str, torch.Tensor]:
    """transformers' module state dicts -> the released checkpoint's tensor names and layout."""
    out = {f"{prefix}patch_embed.proj.{t}": tower[f"patch_embed.proj.{t}"] for t in ("weight", "bias")}
    out[prefix + "patch_embed.pos_emb.weight"] = tower["patch_embed.pos_emb.position_embeddings"]
    renames = (("attn.proj", "wo"), ("norm1", "norm0"), ("norm2", "norm1"), ("mlp.fc1", "mlp.fc0"), ("mlp.fc2", "mlp.fc1"))
    for i in sorted({int(k.split(".")[1]) for k in tower if k.startswith("layers.")}):
        a, b = f"layers.{i}.", f"{prefix}encoder.blocks.{i}."
        for t in ("weight", "bias"):
            out[b + "wqkv." + t] = torch.cat([interleave_rotary_rows(tower[a + f"attn.q_proj.{t}"], heads),
                                              interleave_rotary_rows(tower[a + f"attn.k_proj.{t}"], heads),
                                              tower[a + f"attn.v_proj.{t}"]])
            for theirs, ours in renames:
                out[b + ours + "." + t] = tower[a + theirs + "." + t]
    for t in ("weight", "bias"):
        out[f"{prefix}encoder.final_layernorm.{t}"] = tower[f"final_layernorm.{t}"]
        out[f"{proj_prefix}pre_norm.{t}"] = projector[f"pre_norm.{t}"]
        out[f"{proj_prefix}proj.0.{t}"] = projector[f"in_proj.{t}"]
        out[f"{proj_prefix}proj.2.{t}"] = projector[f"out_proj.{t}"]
    return out
