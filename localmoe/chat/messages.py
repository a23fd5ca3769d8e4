"""OpenAI-style message dicts -> ChatMessages, with errors that name the message and field."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from localmoe.chat.format import ChatFormatError, ChatMessage, ToolCall
from localmoe.chat.images import ImageRef

_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}


IMAGE_PARTS = ("image_url", "input_image")
LoadImage = Callable[[object, str], bytes]  # (the part's URL, where it is) -> the image file's bytes


def _image_url(part: dict) -> object:
    """The URL of an `image_url` part ({"image_url": {"url": ...}} or a bare string) or an `input_image` part."""
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def content_parts(value: Any, where: str, load_image: LoadImage | None = None) -> tuple[str, list[ImageRef]]:
    """A content field: a string, None, or a list of text parts and (with `load_image`) image parts
    (`image_url` / `input_image`), as the text and its images at their character offsets."""
    if value is None:
        return "", []
    if isinstance(value, str):
        return value, []
    if not isinstance(value, list):
        raise ChatFormatError(f"{where}: expected a string or a list of content parts, got {type(value).__name__}")
    texts, refs, at = [], [], 0
    for k, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in IMAGE_PARTS and load_image is not None:
            refs.append(ImageRef.of(load_image(_image_url(part), f"{where}[{k}].{kind}"), at))
            continue
        if kind not in ("text", "input_text", "output_text") or not isinstance(part.get("text"), str):
            supported = "text and image_url parts" if load_image is not None else "only text parts"
            raise ChatFormatError(f"{where}[{k}].type: {supported} are supported here "
                                  f"(got {kind!r}; expected {{'type': 'text', 'text': ...}})")
        texts.append(part["text"])
        at += len(part["text"])
    return "".join(texts), refs


def content_text(value: Any, where: str) -> str:
    """A content field that holds text only: a string, None, or a list of text parts."""
    return content_parts(value, where)[0]


def _optional_str(message: dict, key: str, where: str) -> str | None:
    value = message.get(key)
    if value is not None and not isinstance(value, str):
        raise ChatFormatError(f"{where}.{key}: expected a string, got {type(value).__name__}")
    return value


def _tool_call(call: Any, where: str) -> ToolCall:
    if not isinstance(call, dict):
        raise ChatFormatError(f"{where}: expected an object, got {type(call).__name__}")
    function = call.get("function")
    if not isinstance(function, dict):
        raise ChatFormatError(f"{where}.function: expected an object with name and arguments")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise ChatFormatError(f"{where}.function.name: a tool call needs a function name")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise ChatFormatError(f"{where}.function.arguments: not valid JSON ({e})") from None
    if not isinstance(arguments, dict):
        raise ChatFormatError(f"{where}.function.arguments: expected a JSON object, got {type(arguments).__name__}")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise ChatFormatError(f"{where}.id: expected a string, got {type(call_id).__name__}")
    return ToolCall(name=name, arguments=arguments, id=call_id)


def messages_from_openai(messages: Any, load_image: LoadImage | None = None) -> list[ChatMessage]:
    """ChatMessages from OpenAI chat-completions messages.

    Roles system / developer (-> system) / user / assistant / tool; content a string, None or
    text parts; assistant `reasoning_content` (or `reasoning`) and `tool_calls` whose
    `function.arguments` is a JSON string (or an object); tool messages' `tool_call_id` and
    `name` (looked up from the call they answer when absent); user messages' `image_url` parts
    when `load_image` reads their URLs. Raises ChatFormatError naming `messages[i].field` for
    anything else.
    """
    if not isinstance(messages, list):
        raise ChatFormatError(f"messages: expected a list of messages, got {type(messages).__name__}")
    out: list[ChatMessage] = []
    names: dict[str, str] = {}  # tool_call_id -> function name
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ChatFormatError(f"{where}: expected an object with a role, got {type(message).__name__}")
        role = message.get("role")
        if role not in _ROLES:
            raise ChatFormatError(f"{where}.role: {role!r} is not one of {', '.join(_ROLES)}")
        content, images = content_parts(message.get("content"), f"{where}.content",
                                        load_image if role == "user" else None)
        m = ChatMessage(role=_ROLES[role], content=content, images=images)
        if role == "assistant":
            key = "reasoning_content" if message.get("reasoning_content") is not None else "reasoning"
            m.reasoning = _optional_str(message, key, where)
            calls = message.get("tool_calls") or []
            if not isinstance(calls, list):
                raise ChatFormatError(f"{where}.tool_calls: expected a list, got {type(calls).__name__}")
            m.tool_calls = [_tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(calls)]
            names.update({c.id: c.name for c in m.tool_calls if c.id})
        elif message.get("tool_calls"):
            raise ChatFormatError(f"{where}.tool_calls: only assistant messages carry tool calls, not {role!r}")
        if role == "tool":
            m.tool_call_id = _optional_str(message, "tool_call_id", where)
            m.name = _optional_str(message, "name", where) or names.get(m.tool_call_id or "")
        out.append(m)
    return out
