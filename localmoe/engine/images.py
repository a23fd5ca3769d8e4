"""Image input in the transformer: the vision tower a ModelSpec names (`spec.vision`: a Config of one of
VISION_KINDS), its tensors in the model's expected shapes, and its projected features placed over the
prompt's image placeholder tokens (`spec.image_token_id`)."""

from __future__ import annotations

import bisect
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from localmoe.engine.layers import vision_moonvit, vision_qwen3vl
from localmoe.errors import LocalMoEError
from localmoe.vision import images, moonvit, qwen3vl

VISION_KINDS = {vision_moonvit.Config: vision_moonvit, vision_qwen3vl.Config: vision_qwen3vl}


def _kind(spec):
    return VISION_KINDS[type(spec.vision)]


def vision_tensors(spec) -> dict[str, tuple[int, ...]]:
    """The vision tower's canonical tensors and shapes ({} without one)."""
    return {} if spec.vision is None else _kind(spec).tensors(spec.vision)


def build_vision(spec, weights: dict, device: str = "cpu"):
    """The model's vision tower from the loader's checked weights, or None."""
    return None if spec.vision is None else _kind(spec).build(spec.vision, weights, device=device)


def image_places(tokens: torch.Tensor, image_token_id: int, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, columns) of the placeholder tokens (== image_token_id) in tokens [B, T], in order, on `device`; found
    on the host (the caller's tokens), so placing image rows reads nothing back from the device. LocalMoEError
    unless there are `n`, one per image row."""
    rows, cols = (tokens.cpu() == image_token_id).nonzero(as_tuple=True)
    if rows.numel() != n:
        raise LocalMoEError(f"the prompt holds {rows.numel()} image placeholder tokens (id {image_token_id}) but the "
                            f"images give {n} embeddings: render the prompt from the same images")
    return rows.to(device), cols.to(device)


def embed_with_images(lookup: Callable[[torch.Tensor], torch.Tensor], tokens: torch.Tensor, image_token_id: int,
                      places: tuple[torch.Tensor, torch.Tensor], image_embeds: torch.Tensor) -> torch.Tensor:
    """Token embeddings [B, T, D] (`lookup`: ids -> rows) with the placeholders at `places` (`image_places`) replaced
    by `image_embeds` [n, D], one row per placeholder."""
    x = lookup(tokens.masked_fill(tokens == image_token_id, 0))
    x[places] = image_embeds.to(x.device, x.dtype)
    return x


class ImageEncoder:
    """A model's images turned into placeholder rows once per image content: cached by the sha256 of the
    file's bytes (`images.image_hash`), most recently used kept within `max_bytes`, so a conversation that
    shows an image again does not re-encode it. `seconds` is the time spent encoding (preprocessing + tower),
    `encoded` the images actually run."""

    def __init__(self, model, max_bytes: int = 512 << 20, processor_config: dict | None = None):
        """`processor_config`: the checkpoint's `preprocessor_config.json` (pixel budget, normalisation); the
        tower's own config decides the patch and merge sizes."""
        if getattr(model, "vision", None) is None:
            raise LocalMoEError(f"{model.spec.model_type}: this model has no vision tower; images need a "
                                "vision-capable checkpoint (its config.json has a vision_config)")
        cfg = model.spec.vision
        settings = processor_config or {}
        if isinstance(cfg, vision_moonvit.Config):
            self.processor = moonvit.Processor.from_config(settings, patch_size=cfg.patch_size,
                                                           merge_size=cfg.merge_kernel[0])
            self.merge = cfg.merge_kernel[0]
        else:
            self.processor = qwen3vl.Processor.from_config(settings, patch_size=cfg.patch_size,
                                                           merge_size=cfg.spatial_merge_size,
                                                           temporal_patch_size=cfg.temporal_patch_size)
            self.merge = cfg.spatial_merge_size
        self.model, self.max_bytes, self.seconds, self.encoded = model, max_bytes, 0.0, 0
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._sizes: dict[str, tuple[int, int, int, tuple[int, int]]] = {}
        self._lock = threading.Lock()  # request threads size images while the engine worker encodes them

    @staticmethod
    def _data(source: bytes | str | Path) -> tuple[bytes, str | None]:
        return (source, None) if isinstance(source, bytes) else (Path(source).read_bytes(), str(source))

    def _measure(self, source: bytes | str | Path) -> tuple[int, int, int, tuple[int, int]]:
        data, name = self._data(source)
        key = images.image_hash(data)
        if key not in self._sizes:
            image = images.open_image(data, name=name)
            seen = self.processor.sizes(image.height, image.width)
            h, w = seen[0] if isinstance(self.processor, moonvit.Processor) else seen  # MoonViT: (scaled, padded)
            gh, gw = self.processor.grid(image.height, image.width)
            self._sizes[key] = (w, h, self.processor.tokens(image.height, image.width),
                                (gh // self.merge, gw // self.merge))
        return self._sizes[key]

    def size(self, source: bytes | str | Path) -> tuple[int, int, int]:
        """(width, height) in pixels the tower sees (after the processor's scaling) and the placeholder tokens the
        image takes; `images.ImageError` for anything that is not a usable image."""
        return self._measure(source)[:3]

    def grid(self, source: bytes | str | Path) -> tuple[int, int]:
        """The image's placeholder tokens as (rows, columns): the merged patch grid (MRoPE positions)."""
        return self._measure(source)[3]

    def encode(self, source: bytes | str | Path) -> torch.Tensor:
        """One image (file bytes or a path) -> its rows [tokens, D], or [tokens, 1 + k, D] with a tower's k
        deep-stack feature sets (Qwen3-VL; `Transformer.forward`'s `image_embeds`)."""
        data, name = self._data(source)
        key = images.image_hash(data)
        with self._lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
            start = time.perf_counter()
            patches, grid = self.processor(images.open_image(data, name=name))
            with torch.inference_mode():
                rows = self.model.vision(patches, [grid])[0]
                if isinstance(rows, tuple):  # (embeddings, deep-stack features)
                    rows = torch.stack([rows[0], *rows[1]], dim=1)
            self.seconds += time.perf_counter() - start
            self.encoded += 1
            self.cache[key] = rows
            while len(self.cache) > 1 and sum(r.nbytes for r in self.cache.values()) > self.max_bytes:
                self.cache.popitem(last=False)
            return rows


@dataclass(frozen=True)
class PromptImage:
    """One image of a prompt for a `Decoder`: its content hash, its placeholder count and its rows, encoded when
    first asked for (`rows()`; a prefix cache that already holds the image's positions never asks), and its
    placeholders as a grid of (rows, columns) (MRoPE positions)."""

    key: str
    tokens: int
    rows: Callable[[], torch.Tensor]
    grid: tuple[int, int] = (0, 0)


def prompt_image(encoder: ImageEncoder, data: bytes) -> PromptImage:
    """The PromptImage of one image file's bytes for `encoder`'s model."""
    return PromptImage(images.image_hash(data), encoder.size(data)[2], lambda: encoder.encode(data),
                       encoder.grid(data))


class PromptImages:
    """A prompt's images against its placeholder tokens (`token_id`), in order: `keys` is the prompt with each
    placeholder replaced by its image's key (so a prefix cache never mixes two images with the same token
    count), `rows(begin, end)` the rows of the placeholders among prompt positions [begin, end)."""

    def __init__(self, prompt: Sequence[int], prompt_images: Sequence[PromptImage], token_id: int):
        self.positions = [i for i, t in enumerate(prompt) if t == token_id]
        want = sum(im.tokens for im in prompt_images)
        if len(self.positions) != want:
            raise LocalMoEError(f"the prompt holds {len(self.positions)} image placeholder tokens (id {token_id}) "
                                f"but its {len(prompt_images)} images take {want}: text that spells the placeholder "
                                f"token cannot go with images")
        self.images = list(prompt_images)
        self._mrope: torch.Tensor | None = None
        self.keys: list = list(prompt)
        self.first: list[int] = []  # index of each image's first placeholder
        k = 0
        for im in self.images:
            self.first.append(k)
            for p in self.positions[k:k + im.tokens]:
                self.keys[p] = "image:" + im.key
            k += im.tokens

    def keyed(self, tokens: Sequence[int]) -> list:
        """`tokens` (the prompt's start, then what followed it) with the prompt's placeholders replaced by their keys."""
        out = list(tokens)
        for p in self.positions:
            if p >= len(out):
                break
            out[p] = self.keys[p]
        return out

    def rows(self, begin: int, end: int) -> torch.Tensor | None:
        """The rows [n, D] of the placeholders at prompt positions [begin, end) (None when there are none)."""
        a, b = bisect.bisect_left(self.positions, begin), bisect.bisect_left(self.positions, end)
        parts = []
        for im, first in zip(self.images, self.first):
            lo, hi = max(a, first), min(b, first + im.tokens)
            if lo < hi:
                parts.append(im.rows()[lo - first:hi - first])
        return torch.cat(parts) if parts else None

    def mrope(self, begin: int, end: int) -> torch.Tensor:
        """MRoPE positions [3, end - begin] (temporal, height, width) of prompt positions [begin, end), as
        transformers' Qwen3-VL `get_rope_index` gives them: a text token takes the next position on all three
        axes; an image's placeholders take (p, p + row, p + column) over its grid, p the next position, and
        what follows the image continues from p + max(rows, columns)."""
        if self._mrope is None:
            n = len(self.keys)
            out = torch.empty(3, n, dtype=torch.long)
            at = nxt = 0  # prompt index; next position
            for im, first in zip(self.images, self.first):
                p0 = self.positions[first]
                if self.positions[first + im.tokens - 1] != p0 + im.tokens - 1:
                    raise LocalMoEError(f"image {self.images.index(im) + 1}'s placeholder tokens are not one run")
                out[:, at:p0] = torch.arange(nxt, nxt + p0 - at)
                nxt += p0 - at
                rows, cols = im.grid
                if rows * cols != im.tokens:
                    raise LocalMoEError(f"image grid {rows}x{cols} does not hold its {im.tokens} placeholder tokens")
                out[0, p0:p0 + im.tokens] = nxt
                out[1, p0:p0 + im.tokens] = nxt + torch.arange(rows).repeat_interleave(cols)
                out[2, p0:p0 + im.tokens] = nxt + torch.arange(cols).repeat(rows)
                nxt += max(rows, cols)
                at = p0 + im.tokens
            out[:, at:] = torch.arange(nxt, nxt + n - at)
            self._mrope = out
        return self._mrope[:, begin:end]


def sized(encoder: ImageEncoder, messages: list) -> list:
    """ChatMessages with each image (chat/images.py `ImageRef`) sized by `encoder`'s tower: the width x height it
    sees and its placeholder tokens, which the chat formats render. LocalMoEError naming the message and image."""
    out = []
    for i, m in enumerate(messages):
        refs = []
        for j, ref in enumerate(m.images):
            try:
                width, height, tokens = encoder.size(ref.data)
            except LocalMoEError as e:
                raise LocalMoEError(f"messages[{i}] image {j + 1}: {e}") from None
            refs.append(replace(ref, width=width, height=height, tokens=tokens))
        out.append(replace(m, images=refs) if refs else m)
    return out


def prompt_images(encoder: ImageEncoder, messages: list, prompt: Sequence[int], token_id: int) -> list[PromptImage]:
    """The rendered prompt's images in order (those of `messages`), checked against its placeholder tokens."""
    refs = [ref for m in messages for ref in sorted(m.images, key=lambda r: r.offset)]
    images = [prompt_image(encoder, ref.data) for ref in refs]
    if images:
        PromptImages(prompt, images, token_id)  # raises when the text spelled extra placeholders
    return images
