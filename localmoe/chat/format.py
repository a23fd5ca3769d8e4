"""The one chat-format interface the server and UIs use, whatever the model family.

A `ChatFormat` turns a conversation (`ChatMessage`s with reasoning, tool calls and tool
results) into prompt token ids, and turns the model's output back into a `ParsedReply`
(content, reasoning, tool calls), either at once (`parse`) or incrementally while
streaming (`stream_parser`). Implementations: K3's XTML (chat/xtml.py), gpt-oss harmony
(chat/harmony.py) and the Jinja-template path for every other model (chat/jinja.py);
`chat_format_for(spec, tokenizer)` (chat/__init__.py) picks one. docs/chat-formats.md
describes each layout.

Reasoning effort is "low" | "high" | "max" (None: the format's default). Formats that
take it natively (XTML's thinking-effort message, harmony's `Reasoning:` line) render it;
the budget itself is enforced by the caller, which appends `end_of_thinking_ids()` when
the reasoning budget runs out.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from localmoe.errors import LocalMoEError

REASONING_EFFORTS = ("low", "high", "max")
ROLES = ("system", "user", "assistant", "tool")


class ChatFormatError(LocalMoEError):
    """A conversation, tool list or option a chat format cannot render; the message names the field."""


@dataclass
class ToolCall:
    """One call the assistant made: `arguments` is the decoded JSON object.

    `raw_arguments` holds the text the model wrote when it was not a JSON object (then
    `arguments` is empty); the formats give no `id` (the server assigns one).
    """

    name: str
    arguments: dict[str, Any]
    id: str | None = None
    raw_arguments: str | None = None


@dataclass
class ChatMessage:
    """role: "system" | "user" | "assistant" | "tool".

    Assistant messages may carry `reasoning` and `tool_calls`; tool messages carry the
    result in `content` plus the tool's `name` and the `tool_call_id` they answer.
    `interrupted`: an assistant answer cut short by its client (what had been streamed).
    User messages may carry `images` (chat/images.py `ImageRef`s, each at a character offset of `content`).
    """

    role: str
    content: str = ""
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    name: str | None = None
    tool_call_id: str | None = None
    interrupted: bool = False
    images: list = field(default_factory=list)  # ImageRef (chat/images.py)


@dataclass
class ParsedReply:
    """What an assistant turn said, split by channel."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class Delta:
    """A piece of streamed output: text on one channel ("content" | "reasoning"), or a
    finished tool call."""

    channel: str
    text: str = ""
    tool_call: ToolCall | None = None


class StreamParser(Protocol):
    def feed(self, token_id: int) -> list[Delta]:
        """Consume one generated token; return the deltas it completes (often none)."""

    def flush(self) -> list[Delta]:
        """End of generation: the deltas still held back (a possible partial marker, a cut
        character, a tool call whose stop token was not fed). Call it before `finish` when
        streaming; later calls return nothing."""

    def finish(self) -> ParsedReply:
        """End of generation: flush what is pending (as `flush` does) and return the whole reply."""


class ChatFormat(Protocol):
    name: str
    thinks: bool  # the format has a reasoning channel the model opens by itself

    def render(self, messages: Iterable[ChatMessage], *, tools: list[dict] | None = None,
               reasoning_effort: str | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids. `tools` are OpenAI-style function declarations
        ({"type": "function", "function": {"name", "description", "parameters"}})."""

    def stop_token_ids(self) -> set[int]:
        """Tokens that end an assistant turn."""

    def end_of_thinking_ids(self) -> list[int]:
        """Tokens that close the reasoning channel and open the answer (empty if `thinks` is False)."""

    def parse(self, token_ids: list[int]) -> ParsedReply:
        """Split a finished assistant turn (the generated ids, stop token optional)."""

    def stream_parser(self) -> StreamParser:
        """A fresh incremental parser for one assistant turn."""
