"""Images in the chat screen. `AttachedImage` is one line naming an image (attached with `/image PATH`, or
stored with a resumed session): its name, its size in pixels and, once the model has sized it, the tokens it
takes. Clicking it (or `v` while it has the focus) shows a small preview drawn with half-block characters
(two pixels a cell, so it works over any terminal and SSH); `o` hands the file to the system's viewer (written
once under the cache folder, named by its sha256)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import ClassVar

from PIL import Image
from rich.color import Color
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import Static

from localmoe.paths import cache_dir

PREVIEW = (48, 24)  # the preview's largest size in pixels: 48 columns x 12 text rows


def describe(name: str, ref) -> str:
    """The image's line: what the tower sees (an attached, sized image) or the file's own size (a stored one)."""
    if ref.tokens:
        return f"{name} ({ref.width}x{ref.height} px, {ref.tokens} image tokens)"
    try:
        with Image.open(io.BytesIO(ref.data)) as image:
            return f"{name} ({image.width}x{image.height} px {image.format}, {len(ref.data) / 1024:.1f} KB)"
    except (OSError, ValueError):
        return f"{name} ({len(ref.data)} bytes, not a readable image)"


def half_blocks(data: bytes, size: tuple[int, int] = PREVIEW) -> Text:
    """The image scaled into `size` pixels as rows of '▀' cells: the upper pixel the foreground, the lower the
    background."""
    with Image.open(io.BytesIO(data)) as image:
        image = image.convert("RGB")
    image.thumbnail(size)
    w, h = image.size
    pixels = image.load()
    text = Text(no_wrap=True)
    for y in range(0, h, 2):
        for x in range(w):
            lower = Color.from_rgb(*pixels[x, y + 1]) if y + 1 < h else None
            text.append("▀", Style(color=Color.from_rgb(*pixels[x, y]), bgcolor=lower))
        if y + 2 < h:
            text.append("\n")
    return text


def saved_file(ref) -> Path:
    """The image's bytes as a file under the cache folder (`images/<sha256>.<format>`), written once."""
    try:
        with Image.open(io.BytesIO(ref.data)) as image:
            suffix = {"JPEG": "jpg"}.get(image.format, (image.format or "img").lower())
    except (OSError, ValueError):
        suffix = "bin"
    path = cache_dir() / "images" / f"{ref.sha256}.{suffix}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(ref.data)
    return path


class AttachedImage(Vertical, can_focus=True):
    """One image of a user message: its line (`header`) and a preview (`preview`, hidden until asked for)."""

    DEFAULT_CSS = """
    AttachedImage { height: auto; }
    AttachedImage > .image-preview { width: auto; height: auto; }
    """
    BINDINGS: ClassVar[list[BindingType]] = [Binding("v", "toggle_preview", "view image"),
                                             Binding("o", "open_file", "open image")]

    def __init__(self, name: str, ref):
        super().__init__(classes="user image")
        self.ref = ref
        self.header = Static(f"[image] {describe(name, ref)}  (click: view, o: open)", markup=False)
        self.preview = Static("", classes="image-preview")
        self.preview.display = False

    def compose(self):
        yield self.header
        yield self.preview

    def on_click(self) -> None:
        self.focus()
        self.action_toggle_preview()

    def action_toggle_preview(self) -> None:
        if not self.preview.display:
            try:
                self.preview.update(half_blocks(self.ref.data))
            except (OSError, ValueError) as e:
                self.app.notify(f"cannot draw this image: {e}", severity="error")
                return
        self.preview.display = not self.preview.display

    def action_open_file(self) -> None:
        path = saved_file(self.ref)
        self.app.open_url(path.as_uri())
        self.app.notify(f"opened {path}")
