"""Kimi K2.5 / K3 image preprocessing (transformers' `Kimi_K25ImageProcessor`): scale down to a patch
budget (never up), pad bottom / right with black to a multiple of merge * patch pixels, rescale to
[0, 1], normalise with mean = std = 0.5, cut into patches in raster order."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


@dataclass(frozen=True, slots=True)
class Processor:
    """The processor's settings (its `preprocessor_config.json` names in comments)."""

    patch_size: int = 14
    merge_size: int = 2
    max_patches: int = 16384  # max_patches
    max_side_patches: int = 512  # size.max_height == size.max_width
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_mean
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)  # image_std

    @classmethod
    def from_config(cls, config: dict, **tower) -> Processor:
        """A checkpoint's `preprocessor_config.json` (`max_patches`, `size.max_height`, `image_mean`, `image_std`)
        over the defaults; `tower`: the patch and merge sizes, which the vision tower's config decides."""
        d, size = cls(**tower), config.get("size") or {}
        side = size.get("max_height")
        return cls(**tower, max_patches=int(config.get("max_patches") or d.max_patches),
                   max_side_patches=int(side) if side else d.max_side_patches,
                   mean=tuple(config.get("image_mean") or d.mean), std=tuple(config.get("image_std") or d.std))

    def sizes(self, height: int, width: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """(resized h, w), (padded h, w) in pixels for an image of height x width (`navit_resize`)."""
        p = self.patch_size
        patches = max(1.0, height // p) * max(1.0, width // p)
        scale = min(1.0, math.sqrt(self.max_patches / patches), self.max_side_patches * p / height,
                    self.max_side_patches * p / width)
        h = min(max(1, int(height * scale)), self.max_side_patches * p)
        w = min(max(1, int(width * scale)), self.max_side_patches * p)
        f = self.merge_size * p
        return (h, w), (h + (f - h % f) % f, w + (f - w % f) % f)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """The patch grid (rows, columns) an image of height x width becomes."""
        _, (ph, pw) = self.sizes(height, width)
        return ph // self.patch_size, pw // self.patch_size

    def tokens(self, height: int, width: int) -> int:
        """Placeholder tokens the image takes in the prompt (one per merged block)."""
        gh, gw = self.grid(height, width)
        return gh * gw // (self.merge_size * self.merge_size)

    def __call__(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int]]:
        """An RGB image -> patches [h * w, 3, p, p] (float32, raster order) and its grid (h, w)."""
        (h, w), (ph, pw) = self.sizes(image.height, image.width)
        if (h, w) != (image.height, image.width):
            image = image.resize((w, h), Image.Resampling.BICUBIC)
        pixels = np.zeros((ph, pw, 3), dtype=np.float32)
        pixels[:h, :w] = np.asarray(image.convert("RGB"), dtype=np.float32)
        x = torch.from_numpy(pixels).permute(2, 0, 1) / 255.0
        x = (x - torch.tensor(self.mean)[:, None, None]) / torch.tensor(self.std)[:, None, None]
        p = self.patch_size
        gh, gw = ph // p, pw // p
        patches = x.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches.contiguous(), (gh, gw)
