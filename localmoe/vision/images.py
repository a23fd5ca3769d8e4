"""Decode and check an image (a file or bytes) into an RGB Pillow image, refusing what no tower should see."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

from PIL import Image

from localmoe.errors import LocalMoEError

MAX_SIDE = 16384  # pixels: larger images are refused, not decoded
MAX_PIXELS = 64 * 1024 * 1024


class ImageError(LocalMoEError, ValueError):
    """An input that is not a usable image; the message names it and says what is wrong."""


def image_hash(data: bytes) -> str:
    """The key images are cached and stored by: sha256 of the file's bytes."""
    return hashlib.sha256(data).hexdigest()


def open_image(source: bytes | str | Path, name: str | None = None) -> Image.Image:
    """An RGB image from file bytes or a path; `ImageError` for anything else (not an image, truncated,
    larger than MAX_SIDE on a side or MAX_PIXELS in all). Transparent pixels are composed on white."""
    label = name or (str(source) if not isinstance(source, bytes) else "image")
    data = source if isinstance(source, bytes) else Path(source).read_bytes()
    try:
        with Image.open(io.BytesIO(data)) as probe:
            w, h = probe.size
            if w > MAX_SIDE or h > MAX_SIDE or w * h > MAX_PIXELS:
                raise ImageError(f"{label}: {w}x{h} pixels is too large (at most {MAX_SIDE} a side, "
                                 f"{MAX_PIXELS} in all); scale it down first")
            probe.load()
            img = probe.copy()
    except ImageError:
        raise
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"{label}: not a readable image ({e})") from e
    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        canvas = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(canvas, img)
    return img.convert("RGB")
