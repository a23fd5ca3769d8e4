"""A conversation's images made ready for the model: each `ImageRef` sized by the model's tower (so the chat format
renders the right number of placeholder tokens) and, once the prompt is rendered, the `PromptImage`s a `Decoder`
places over those placeholders (encoded when a prompt chunk first needs them, once per image content)."""

from __future__ import annotations

from localmoe.chat.format import ChatMessage
from localmoe.engine.images import PromptImage, sized
from localmoe.engine.images import prompt_images as engine_prompt_images
from localmoe.errors import LocalMoEError, RequestError

MAX_IMAGES = 64  # images in one conversation (its history included)


def size_images(loaded, messages: list[ChatMessage]) -> list[ChatMessage]:
    """`messages` with every image sized for `loaded`'s tower; a RequestError (400) naming the message when the model
    has no tower, an image is not usable, or there are more than MAX_IMAGES."""
    count = sum(len(m.images) for m in messages)
    if not count:
        return messages
    try:
        encoder = loaded.image_encoder
    except LocalMoEError as e:
        raise RequestError(f"messages: the request holds {count} image(s) but {e}", param="messages") from None
    if count > MAX_IMAGES:
        raise RequestError(f"messages: the conversation holds {count} images, more than the {MAX_IMAGES} one request "
                           f"may show; send fewer (start a new conversation)", param="messages")
    try:
        return sized(encoder, messages)
    except LocalMoEError as e:
        raise RequestError(str(e), param="messages") from None


def prompt_images(loaded, messages: list[ChatMessage], prompt: list[int]) -> list[PromptImage]:
    """The rendered prompt's images in order (those of `messages`), checked against its placeholder tokens."""
    if not any(m.images for m in messages):
        return []
    try:
        return engine_prompt_images(loaded.image_encoder, messages, prompt, loaded.spec.image_token_id)
    except LocalMoEError as e:
        raise RequestError(f"messages: {e}", param="messages") from None
