"""Fitting a conversation into the context: tool outputs are compressed first, oldest first,
and the model's own reasoning never."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from localmoe.chat.format import ChatMessage
from localmoe.errors import RequestError

KEEP = 256  # characters kept at each end of a compressed tool output


def _shorten(text: str) -> str:
    if len(text) <= 2 * KEEP + 80:
        return text
    omitted = len(text) - 2 * KEEP
    return f"{text[:KEEP]}\n[... {omitted} characters of tool output omitted to fit the context ...]\n{text[-KEEP:]}"


def _placeholder(text: str) -> str:
    return f"[{len(text)} characters of tool output omitted to fit the context]"


def fit_messages(messages: list[ChatMessage], render: Callable[[list[ChatMessage]], list[int]],
                 limit: int) -> tuple[list[int], list[ChatMessage]]:
    """Prompt ids of at most `limit` tokens and the messages they render.

    Pass 1 keeps each tool output's head and tail, pass 2 replaces whole outputs by a
    note, both oldest first; other messages are never changed. Raises a RequestError when
    the conversation still does not fit.
    """
    ids = render(messages)
    if len(ids) <= limit:
        return ids, messages
    messages = list(messages)
    tool_indices = [i for i, m in enumerate(messages) if m.role == "tool" and m.content]
    for shrink in (_shorten, _placeholder):
        for i in tool_indices:
            original = messages[i].content
            shorter = shrink(original)
            if shorter == original:
                continue
            messages[i] = replace(messages[i], content=shorter)
            ids = render(messages)
            if len(ids) <= limit:
                return ids, messages
    raise RequestError(f"the conversation needs {len(ids)} prompt tokens but at most {limit} fit "
                        f"(context minus max_tokens); shorten the messages or lower max_tokens",
                   param="messages", code="context_length_exceeded")
