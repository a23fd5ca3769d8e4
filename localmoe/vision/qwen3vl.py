"""Qwen3-VL image preprocessing (transformers' `Qwen2VLImageProcessor` rules with Qwen3-VL's
`preprocessor_config.json` values): resize so both sides are multiples of merge * patch pixels and the
area lies within [min_pixels, max_pixels] (`smart_resize`), rescale to [0, 1], normalise, cut into
patches in spatial-merge-block order, each patch repeated over the temporal slots."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from localmoe.vision.images import ImageError


@dataclass(frozen=True, slots=True)
class Processor:
    """The processor's settings (its `preprocessor_config.json` names in comments)."""

    patch_size: int = 16
    merge_size: int = 2
    temporal_patch_size: int = 2
    min_pixels: int = 65536  # size.shortest_edge
    max_pixels: int = 16777216  # size.longest_edge
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_mean
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_std

    @classmethod
    def from_config(cls, config: dict, **tower) -> Processor:
        """A checkpoint's `preprocessor_config.json` (`size.shortest_edge` / `longest_edge`, or the older
        `min_pixels` / `max_pixels`; `image_mean`, `image_std`) over the defaults; `tower`: the patch, merge and
        temporal sizes, which the vision tower's config decides."""
        d, size = cls(**tower), config.get("size") or {}
        return cls(**tower, min_pixels=int(size.get("shortest_edge") or config.get("min_pixels") or d.min_pixels),
                   max_pixels=int(size.get("longest_edge") or config.get("max_pixels") or d.max_pixels),
                   mean=tuple(config.get("image_mean") or d.mean), std=tuple(config.get("image_std") or d.std))

    def sizes(self, height: int, width: int) -> tuple[int, int]:
        """The resized (h, w) in pixels (`smart_resize`)."""
        f = self.patch_size * self.merge_size
        if max(height, width) / min(height, width) > 200:
            raise ImageError(f"image of {width}x{height} pixels: the aspect ratio must be at most 200")
        h, w = round(height / f) * f, round(width / f) * f
        if h * w > self.max_pixels:
            beta = math.sqrt(height * width / self.max_pixels)
            h, w = max(f, math.floor(height / beta / f) * f), max(f, math.floor(width / beta / f) * f)
        elif h * w < self.min_pixels:
            beta = math.sqrt(self.min_pixels / (height * width))
            h, w = math.ceil(height * beta / f) * f, math.ceil(width * beta / f) * f
        return h, w

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) an image of height x width becomes."""
        h, w = self.sizes(height, width)
        return h // self.patch_size, w // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """Placeholder tokens the image takes in the prompt (one per merged block)."""
        gh, gw = self.grid(height, width)
        return gh * gw // (self.merge_size * self.merge_size)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """An RGB image -> patches [h * w, 3 * temporal * p * p] (float32, merge-block order) and its grid."""
        h, w = self.sizes(image.height, image.width)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        x = torch.from_numpy(np.asarray(image.convert("RGB"), dtype=np.float32)).permute(2, 0, 1) / 255.0
        x = (x - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]
        p, m, t = self.patch_size, self.merge_size, self.temporal_patch_size
        gh, gw = h // p, w // p
        x = x.reshape(3, gh // m, m, p, gw // m, m, p).permute(1, 4, 2, 5, 0, 3, 6)  # [bh, bw, m, m, C, p, p]
        x = x.unsqueeze(5).expand(-1, -1, -1, -1, -1, t, -1, -1)
        return x.reshape(gh * gw, 3 * t * p * p).contiguous(), (gh, gw)
