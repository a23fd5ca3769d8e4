"""Request body of the Anthropic-compatible `/v1/messages` endpoint."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator

from localmoe.server.schemas import MAX_SEED, NAME, NAME_FIELD, Body, RequestBody, check_parameters
from localmoe.server.structured import JSONOutputFormat


class TextBlock(Body):
    type: Literal["text"]
    text: str


class ThinkingBlock(Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Body):
    type: Literal["redacted_thinking"]
    data: str


class ToolUseBlock(Body):
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64)
    input: dict[str, Any]


class ToolResultBlock(Body):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=128)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(b.text for b in self.content)


class ImageBlock(Body):
    type: Literal["image", "document"]
    source: dict[str, Any]


Block = Annotated[
    TextBlock | ThinkingBlock | RedactedThinkingBlock | ToolUseBlock | ToolResultBlock | ImageBlock,
    Field(discriminator="type"),
]


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | Annotated[list[Block], Field(max_length=10_000)]


class AnthropicTool(Body):
    name: str = Field(json_schema_extra=NAME_FIELD)
    description: str | None = Field(default=None, max_length=100_000)
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError("tool names are 1-64 letters, digits, '_', '-' or '.'")
        return v

    @field_validator("input_schema")
    @classmethod
    def _schema(cls, v: dict) -> dict:
        return check_parameters(v, "input_schema")


class AnthropicToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(default=None, max_length=64)
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(Body):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)


class ThinkingDisabled(Body):
    type: Literal["disabled"]


class ThinkingAdaptive(Body):
    """The model decides how much to think: the effort tier's budget applies."""

    type: Literal["adaptive", "between_tools"]
    display: Literal["summarized", "omitted"] | None = None


class OutputConfig(Body):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JSONOutputFormat | None = None  # the answer is JSON valid against its schema (the grammar engine)


# output_config.effort -> the thinking-budget tier (docs/api.md): low -> low, medium and high -> high,
# xhigh and max -> max
EFFORT_TIER = {"low": "low", "medium": "high", "high": "high", "xhigh": "max", "max": "max"}


class MessagesRequest(RequestBody):
    model: str = Field(max_length=256)
    max_tokens: int = Field(ge=1)
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=10_000)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=16)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    # localmoe sampling extensions (the anthropic SDK sends these, and temperature, through extra_body)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    thinking: Annotated[ThinkingEnabled | ThinkingDisabled | ThinkingAdaptive, Field(discriminator="type")] | None = (
        None
    )
    output_config: OutputConfig | None = None
    tools: list[AnthropicTool] | None = Field(default=None, max_length=256)
    tool_choice: AnthropicToolChoice | None = None
    metadata: dict[str, Any] | None = None
    # localmoe extensions
    session_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    max_time_s: float | None = Field(default=None, gt=0)
    max_bytes_read: int | None = Field(default=None, gt=0)

    def system_text(self) -> str | None:
        if self.system is None:
            return None
        return self.system if isinstance(self.system, str) else "\n".join(b.text for b in self.system)


class CountTokensRequest(MessagesRequest):
    """`/v1/messages/count_tokens`: a messages body whose max_tokens is optional."""

    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
