"""Request bodies of the OpenAI-compatible endpoints (pydantic; unknown fields are ignored,
as OpenAI-compatible servers do). Field limits here are what the OpenAPI schema shows;
limits that depend on the model (context, max_tokens) are checked by the handlers."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from localmoe.server.structured import ResponseFormat

MAX_SEED = 2**53 - 1  # the integers JSON carries exactly (RFC 8259): a schema's bound survives float parsers
NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def unicode_error(value: Any, where: str = "") -> str | None:
    """Where `value` (parsed JSON) holds text that is not valid Unicode (a lone surrogate such as
    "\\ud800", which JSON escapes can spell but no tokenizer can read), or None."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as e:
                return (f"{at or 'body'}: text is not valid Unicode (a lone surrogate {item[e.start]!r} at character "
                        f"{e.start}); send text that is valid UTF-8")
        elif isinstance(item, dict):
            stack += [(k, f"{at} (a key)".lstrip()) for k in item]
            stack += [(v, f"{at}.{_printable(k)}".lstrip(".")) for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{at}.{i}".lstrip(".")) for i, v in enumerate(item)]
    return None


def _printable(key: object) -> str:
    return str(key).encode("utf-8", "backslashreplace").decode("utf-8")


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class RequestBody(Body):
    """A whole request body: its text is checked for valid Unicode before any field is read."""

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data: Any) -> Any:
        if (message := unicode_error(data)) is not None:
            raise ValueError(message)
        return data


def check_json_schema(schema: Any, where: str, depth: int = 0) -> None:
    """A tool's parameters: a JSON-schema object with known types (ValueError naming the field)."""
    if not isinstance(schema, dict):
        raise ValueError(f"{where} must be a JSON schema object")  # noqa: TRY004 - pydantic reports ValueError
    if depth > 16:
        raise ValueError(f"{where} nests deeper than 16 levels")
    declared = schema.get("type")
    if declared is not None:
        names = [declared] if isinstance(declared, str) else declared
        if not isinstance(names, list) or not names or any(not isinstance(n, str) or n not in JSON_TYPES
                                                           for n in names):
            raise ValueError(f"{where}.type must be one of {', '.join(sorted(JSON_TYPES))}")
    properties = schema.get("properties")
    if properties is not None:
        if not isinstance(properties, dict):
            raise ValueError(f"{where}.properties must be an object")
        for key, sub in properties.items():
            check_json_schema(sub, f"{where}.properties.{key}", depth + 1)
    required = schema.get("required")
    if required is not None and (not isinstance(required, list) or any(not isinstance(k, str) for k in required)):
        raise ValueError(f"{where}.required must be a list of property names")
    if "items" in schema:
        check_json_schema(schema["items"], f"{where}.items", depth + 1)
    if "enum" in schema and (not isinstance(schema["enum"], list) or not schema["enum"]):
        raise ValueError(f"{where}.enum must be a non-empty list")


def check_parameters(schema: dict | None, where: str) -> dict:
    if schema is None:
        return {"type": "object", "properties": {}}
    check_json_schema(schema, where)
    if schema.get("type", "object") != "object":
        raise ValueError(f"{where}.type must be \"object\": tool arguments are a JSON object")
    return schema


class TextPart(Body):
    type: Literal["text"]
    text: str


class FunctionCallIn(Body):
    name: str = Field(min_length=1, max_length=64)
    arguments: str = Field(max_length=1_000_000)


class ToolCallIn(Body):
    id: str | None = Field(default=None, max_length=128)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ImageUrl(Body):
    url: str = Field(min_length=1)  # data:image/...;base64,... or file:///path under --documents-root
    detail: Literal["auto", "low", "high"] | None = None


class ImageUrlPart(Body):
    type: Literal["image_url"]
    image_url: ImageUrl


ContentPart = Annotated[TextPart | ImageUrlPart, Field(discriminator="type")]


class MessageIn(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=10_000)] | None = None
    name: str | None = Field(default=None, max_length=64)
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)
    tool_call_id: str | None = Field(default=None, max_length=128)
    reasoning_content: str | None = None


NAME_FIELD = {"pattern": NAME.pattern}  # shown in the schema; the validators below give the clearer message


class FunctionDecl(Body):
    name: str = Field(json_schema_extra=NAME_FIELD)
    description: str | None = Field(default=None, max_length=100_000)
    parameters: dict | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME.match(v):
            raise ValueError("function names are 1-64 letters, digits, '_', '-' or '.'")
        return v

    @field_validator("parameters")
    @classmethod
    def _parameters(cls, v: dict | None) -> dict:
        return check_parameters(v, "parameters")


class ToolDecl(Body):
    type: Literal["function"]
    function: FunctionDecl


class NamedFunction(Body):
    name: str = Field(min_length=1, max_length=64)


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(Body):
    include_usage: bool = False


Effort = Literal["minimal", "low", "medium", "high", "max"]
EFFORT_TIER = {"minimal": "low", "low": "low", "medium": "high", "high": "high", "max": "max"}


class Sampling(RequestBody):
    """Sampling fields both OpenAI endpoints share (top_k, min_p, repetition_penalty: extensions)."""

    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=0, le=1_000_000)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=10)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)  # accepted, not applied
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)  # accepted, not applied
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    # localmoe extension: this request's speculative decoding (None: the server's --spec; "draft" and
    # "prompt+draft" need the server to run --spec draft:PATH or prompt+draft:PATH, "mtp" --spec mtp with a model
    # that has an MTP layer)
    spec: Literal["off", "prompt", "draft", "prompt+draft", "mtp"] | None = None

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(Sampling):
    model: str = Field(max_length=256)
    messages: list[MessageIn] = Field(min_length=1, max_length=10_000)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolDecl] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    reasoning_effort: Effort | None = None
    response_format: ResponseFormat | None = None
    logprobs: Literal[False] | None = None
    # localmoe extensions
    session_id: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]{1,128}$")
    max_reasoning_tokens: int | None = Field(default=None, ge=1)
    max_time_s: float | None = Field(default=None, gt=0)
    max_bytes_read: int | None = Field(default=None, gt=0)


class CompletionRequest(Sampling):
    model: str = Field(max_length=256)
    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[
        list[int], Field(min_length=1)]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: None = None
    logprobs: None = None
    best_of: int | None = Field(default=None, ge=1, le=1)

