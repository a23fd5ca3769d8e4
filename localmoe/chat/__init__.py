"""Chat formats: conversations -> prompt ids, generated ids -> content, reasoning and tool calls.

`chat_format_for(spec, tokenizer)` picks the format of a model family (docs/chat-formats.md).
"""

from __future__ import annotations

from localmoe.chat.format import (
    REASONING_EFFORTS,
    ROLES,
    ChatFormat,
    ChatFormatError,
    ChatMessage,
    Delta,
    ParsedReply,
    StreamParser,
    ToolCall,
)
from localmoe.chat.harmony import HarmonyFormat
from localmoe.chat.jinja import JinjaFormat
from localmoe.chat.messages import messages_from_openai
from localmoe.chat.xtml import XtmlFormat

FORMATS = {"kimi_k3": XtmlFormat, "gpt_oss": HarmonyFormat}  # family -> format; others use the Jinja template


def chat_format_for(spec, tokenizer) -> ChatFormat:
    """The chat format of a model: `spec` is its ModelSpec (or the family name), `tokenizer` its Tokenizer."""
    family = spec if isinstance(spec, str) else spec.family
    return FORMATS.get(family, JinjaFormat)(tokenizer)


__all__ = [
    "FORMATS", "REASONING_EFFORTS", "ROLES", "ChatFormat", "ChatFormatError", "ChatMessage", "Delta",
    "HarmonyFormat", "JinjaFormat", "ParsedReply", "StreamParser", "ToolCall", "XtmlFormat", "chat_format_for",
    "messages_from_openai",
]
