"""Image sources the API routes accept, turned into file bytes: `data:` URLs (base64), `file:` URLs of files under
the `--documents-root` folders (the one path guard, localmoe.pathguard), and Anthropic base64 sources. The server
makes no network fetches: any other URL is a 400. Whether the bytes are a usable image is the model's tower's
check (runtime/images.py), which names the message and image."""

from __future__ import annotations

import base64
import binascii
import stat
from collections.abc import Callable
from pathlib import Path
from urllib.parse import unquote, urlsplit

from localmoe.pathguard import PathRefused, resolve_inside, shown
from localmoe.server.errors import APIError

MAX_IMAGE_BYTES = 20 << 20  # one image file
MEDIA_TYPES = ("image/png", "image/jpeg", "image/gif", "image/webp", "image/bmp", "image/tiff")


def _base64(payload: str, where: str) -> bytes:
    if len(payload) > MAX_IMAGE_BYTES * 4 // 3 + 4:
        raise APIError(413, f"{where}: the image is larger than {MAX_IMAGE_BYTES >> 20} MiB; scale it down first")
    try:
        data = base64.b64decode(payload.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{where}: the image data is not valid base64") from None
    if not data:
        raise APIError(400, f"{where}: the image data is empty")
    return data


def _media_type(media_type: str, where: str) -> None:
    if media_type.lower() not in MEDIA_TYPES:
        raise APIError(400, f"{where}: media type {media_type[:80]!r} is not an image type this server reads "
                            f"({', '.join(MEDIA_TYPES)})")


def _data_url(url: str, where: str) -> bytes:
    head, comma, payload = url[len("data:"):].partition(",")
    if not comma:
        raise APIError(400, f"{where}: a data URL is data:image/png;base64,<data> (no comma found)")
    media_type, *params = head.split(";")
    if "base64" not in params:
        raise APIError(400, f"{where}: only base64 data URLs are read (data:{media_type or 'image/png'};base64,...)")
    _media_type(media_type, where)
    return _base64(payload, where)


def _file_url(url: str, roots: tuple[Path, ...], where: str) -> bytes:
    if not roots:
        raise APIError(400, f"{where}: file URLs are read only under --documents-root folders, and this server has "
                            f"none; send the image as a data URL (data:image/png;base64,...)")
    try:
        parts = urlsplit(url)
    except ValueError:
        raise APIError(400, f"{where}: not a valid file URL (file:///absolute/path)") from None
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise APIError(400, f"{where}: a file URL is file:///absolute/path (no host, query or fragment)")
    path = unquote(parts.path)
    if not path.startswith("/"):
        raise APIError(400, f"{where}: a file URL needs an absolute path (file:///...)")
    try:
        real = resolve_inside(path, roots)
    except PathRefused as e:
        raise APIError(403 if e.outside else 400, f"{where}: {e} (image files must lie inside the --documents-root "
                                                  f"folders)") from None
    try:
        info = real.stat()
    except OSError:
        raise APIError(400, f"{where}: no such image file on the server: {shown(path)}") from None
    if not stat.S_ISREG(info.st_mode):
        raise APIError(400, f"{where}: {shown(path)} is not a regular file")
    if info.st_size > MAX_IMAGE_BYTES:
        raise APIError(413, f"{where}: {shown(path)} is larger than {MAX_IMAGE_BYTES >> 20} MiB")
    with real.open("rb") as f:
        return f.read(MAX_IMAGE_BYTES + 1)[:MAX_IMAGE_BYTES]


def image_url_bytes(url: object, roots: tuple[Path, ...], where: str) -> bytes:
    """The bytes an OpenAI `image_url` (or Responses `input_image`) URL names; APIError (4xx) otherwise."""
    if not isinstance(url, str) or not url:
        raise APIError(400, f"{where}: expected an image URL (data:image/png;base64,... or file:///path)")
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where)
    if scheme == "file":
        return _file_url(url, roots, where)
    raise APIError(400, f"{where}: only data: URLs and file: URLs under --documents-root are read; this server "
                        f"makes no network fetches (send the image as data:image/png;base64,...)")


def url_loader(roots: tuple[Path, ...]) -> Callable[[object, str], bytes]:
    """`load_image(url, where)` for messages_from_openai, reading under `roots`."""
    return lambda url, where: image_url_bytes(url, roots, where)


def anthropic_source_bytes(source: dict, roots: tuple[Path, ...], where: str) -> bytes:
    """The bytes of an Anthropic image block's `source`: {"type": "base64", "media_type", "data"} (or a "url"
    source holding a data: or file: URL); APIError (4xx) otherwise."""
    kind = source.get("type")
    if kind == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if not isinstance(media_type, str) or not isinstance(data, str):
            raise APIError(400, f"{where}.source: a base64 source needs media_type and data strings")
        _media_type(media_type, f"{where}.source.media_type")
        return _base64(data, f"{where}.source.data")
    if kind == "url":
        return image_url_bytes(source.get("url"), roots, f"{where}.source.url")
    raise APIError(400, f"{where}.source.type: {str(kind)[:40]!r} is not read here (base64, or a url source with a "
                        f"data: or file: URL)")
