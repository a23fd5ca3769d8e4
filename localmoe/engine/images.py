"""Image input in the transformer: the vision tower a ModelSpec names (`spec.vision`: a Config of one of
VISION_KINDS), its tensors in the model's expected shapes, and its projected features placed over the
prompt's image placeholder tokens (`spec.image_token_id`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch

from localmoe.engine.layers import vision_moonvit, vision_qwen3vl
from localmoe.errors import LocalMoEError
from localmoe.vision import images, moonvit

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
    x[mask] = image_embeds.to(x.device, x.dtype)
    return x


class ImageEncoder:
    """A model's images turned into placeholder rows once per image content: cached by the sha256 of the
    file's bytes (`images.image_hash`), so a conversation that shows an image again does not re-encode it.
    `seconds` is the time spent encoding (preprocessing + tower), `encoded` the images actually run."""

    def __init__(self, model):
        if getattr(model, "vision", None) is None:
            raise LocalMoEError(f"{model.spec.model_type}: this model has no vision tower; images need a "
                                "vision-capable checkpoint (its config.json has a vision_config)")
        if not isinstance(model.spec.vision, vision_moonvit.Config):
            raise LocalMoEError(f"{model.spec.model_type}: image prompts are not wired for this tower yet")
        self.model, self.cache, self.seconds, self.encoded = model, {}, 0.0, 0

    def encode(self, source: bytes | str | Path) -> torch.Tensor:
        """One image (file bytes or a path) -> its rows [tokens, D]."""
        data = source if isinstance(source, bytes) else Path(source).read_bytes()
        key = images.image_hash(data)
        if key not in self.cache:
            start = time.perf_counter()
            cfg = self.model.spec.vision
            processor = moonvit.Processor(patch_size=cfg.patch_size, merge_size=cfg.merge_kernel[0])
            image = images.open_image(data, name=None if isinstance(source, bytes) else str(source))
            patches, grid = processor(image)
            self.cache[key] = self.model.vision(patches, [grid])[0]
            self.seconds += time.perf_counter() - start
            self.encoded += 1
        return self.cache[key]


MOONVIT_IMAGE = ("<|media_begin|>image<|media_content|>", "<|media_pad|>", "<|media_end|>")


def image_text(rows: torch.Tensor) -> str:
    """The prompt text of one MoonViT image: its placeholder token once per row, between the media markers."""
    begin, pad, end = MOONVIT_IMAGE
    return begin + pad * rows.shape[0] + end


class ImageFeed:
    """A model whose forward calls take the queued image rows for the placeholders each call holds, in order
    (the prompt may be prefilled in chunks); everything else is the wrapped model's."""

    def __init__(self, model, rows: list[torch.Tensor]):
        self._model = model
        self._queue = torch.cat(rows) if rows else None

    def __getattr__(self, name):
        return getattr(self._model, name)

    def forward(self, tokens: torch.Tensor, cache, mask=None, all_logits: bool = False) -> torch.Tensor:
        n = int((tokens == self._model.spec.image_token_id).sum())
        if n == 0:
            return self._model.forward(tokens, cache, mask, all_logits)
        if self._queue is None or self._queue.shape[0] < n:
            raise LocalMoEError("the prompt holds more image placeholder tokens than the images give rows")
        rows, self._queue = self._queue[:n], self._queue[n:]
        return self._model.forward(tokens, cache, mask, all_logits, image_embeds=rows)
