"""Images in a conversation: `ImageRef` (an image's bytes, content hash and place in its message's text) and the
image placeholders each chat format renders (MODELS.md, "Vision towers").

A user message's `images` sit at character offsets of its `content`, so text and images keep their order and
everything that reads `content` as text (context fitting, sessions, the UIs) keeps working. How many placeholder
tokens an image takes depends on the model's tower, so the runtime sizes each ref (`width`, `height`, `tokens`:
what the tower sees) before a format renders it; a format renders an unsized ref as an error.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from localmoe.chat.format import ChatFormatError, ChatMessage

KIMI_MEDIA = ("<|media_begin|>", "<|media_content|>", "<|media_pad|>", "<|media_end|>")  # Kimi K2.5 / K3
QWEN_VISION = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")  # Qwen-VL


@dataclass(frozen=True)
class ImageRef:
    """One image of a message: its file bytes, their sha256 (how sessions store it and the encoder caches it),
    the character offset in the message's content it goes before, and, once the runtime has sized it for the
    model, the width x height in pixels the tower sees and the placeholder tokens it takes."""

    sha256: str
    data: bytes = field(repr=False, compare=False)
    offset: int = 0
    width: int = 0
    height: int = 0
    tokens: int = 0

    @classmethod
    def of(cls, data: bytes, offset: int = 0) -> ImageRef:
        return cls(hashlib.sha256(data).hexdigest(), data, offset)


def message_pieces(m: ChatMessage, image: Callable[[ImageRef], list]) -> list:
    """The message's content as pieces in order: text (str) and, at each image's offset, `image(ref)`'s pieces."""
    if not m.images:
        return [m.content]
    pieces, at = [], 0
    for ref in sorted(m.images, key=lambda r: r.offset):
        if not ref.tokens:
            raise ChatFormatError(f"image {ref.sha256[:12]}: not sized for this model (the runtime sizes images "
                                  f"before rendering)")
        pieces += [m.content[at:ref.offset], *image(ref)]
        at = ref.offset
    return [*pieces, m.content[at:]]


def media_ids(tokenizer, names: tuple[str, ...], family: str) -> list[int]:
    """The ids of a placeholder layout's special tokens; ChatFormatError when the tokenizer lacks one."""
    ids = [tokenizer.token_to_id(name) for name in names]
    if None in ids:
        missing = names[ids.index(None)]
        raise ChatFormatError(f"{tokenizer.source}: this model's tokenizer has no {missing!r}, so the {family} chat "
                              f"format cannot show it images; use a vision-capable checkpoint")
    return ids


def template_image_text(tokenizer) -> Callable[[ImageRef], str]:
    """For template-rendered formats (the text is encoded with special tokens matched): an image's placeholder as
    text, in the layout the tokenizer's vocabulary holds (Kimi media tokens or Qwen-VL vision tokens)."""
    if tokenizer.token_to_id(KIMI_MEDIA[2]) is not None:
        begin, content, pad, end = KIMI_MEDIA
        return lambda ref: f"{begin}image{content}{pad * ref.tokens}{end}"
    if tokenizer.token_to_id(QWEN_VISION[1]) is not None:
        start, pad, end = QWEN_VISION
        return lambda ref: f"{start}{pad * ref.tokens}{end}"

    def refuse(ref: ImageRef) -> str:
        raise ChatFormatError(f"{tokenizer.source}: this model's tokenizer has no image placeholder token "
                              f"({KIMI_MEDIA[2]} or {QWEN_VISION[1]}); use a vision-capable checkpoint")
    return refuse
