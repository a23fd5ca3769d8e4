"""Image input in the transformer: the vision tower a ModelSpec names (`spec.vision`: a Config of one of
VISION_KINDS), its tensors in the model's expected shapes, and its projected features placed over the
prompt's image placeholder tokens (`spec.image_token_id`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from localmoe.engine.layers import vision_moonvit, vision_qwen3vl
from localmoe.errors import LocalMoEError

VISION_KINDS = {vision_moonvit.Config: vision_moonvit, vision_qwen3vl.Config: vision_qwen3vl}


def _kind(spec):
    return VISION_KINDS[type(spec.vision)]


def vision_tensors(spec) -> dict[str, tuple[int, ...]]:
    """The vision tower's canonical tensors and shapes ({} without one)."""
    return {} if spec.vision is None else _kind(spec).tensors(spec.vision)


def build_vision(spec, weights: dict, device: str = "cpu"):
    """The model's vision tower from the loader's checked weights, or None."""
    return None if spec.vision is None else _kind(spec).build(spec.vision, weights, device=device)


def embed_with_images(lookup: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, image_token_id: int,
                      image_embeds: torch.Tensor) -> torch.Tensor:
    """Token embeddings [B, T, D] (`lookup`: ids -> rows) with the placeholder positions (tokens == image_token_id, in order) replaced
    by `image_embeds` [n, D], one row per placeholder."""
    mask = tokens == image_token_id
    n = int(mask.sum())
    if n != image_embeds.shape[0]:
        raise LocalMoEError(f"the prompt holds {n} image placeholder tokens (id {image_token_id}) but the "
                            f"images give {image_embeds.shape[0]} embeddings: render the prompt from the same images")
    x = lookup(tokens.masked_fill(mask, 0))
    x[mask] = image_embeds.to(x.dtype)
    return x
