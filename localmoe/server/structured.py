"""Structured-output request fields of every API, read into one JSON schema for the grammar
engine (chat/grammar.py): OpenAI chat `response_format`, Responses `text.format` and
Anthropic `output_config.format`."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from localmoe.chat.grammar import closed

FORMAT_NAME = r"^[A-Za-z0-9_-]{1,64}$"


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)


class JSONSchemaSpec(_Body):
    """OpenAI's `json_schema` object: a named schema; `strict` keeps objects to their declared keys."""

    name: str = Field(default="output", pattern=FORMAT_NAME)
    description: str | None = Field(default=None, max_length=100_000)
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """Chat completions' `response_format`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None


class TextFormat(_Body):
    """Responses' `text.format`: the json_schema fields sit beside `type`."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = Field(default="output", pattern=FORMAT_NAME)
    description: str | None = Field(default=None, max_length=100_000)
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class JSONOutputFormat(_Body):
    """Anthropic's `output_config.format`; its objects are closed, as Anthropic's structured outputs require."""

    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")

    def output_schema(self) -> dict:
        return closed(self.schema_)


def output_schema(kind: str, schema: dict | None, strict: bool | None) -> dict | None:
    """The schema the answer must match (None: free text). `strict` (OpenAI's default for
    Responses, opt-in for chat) closes objects to their declared properties."""
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "object"}
    if schema is None:  # pragma: no cover - the models require it; kept for direct callers
        return {}
    return closed(schema) if strict else schema


def chat_output_schema(fmt: ResponseFormat | None) -> dict | None:
    """`response_format` -> schema; a json_schema without its `json_schema` object is a ValueError."""
    if fmt is None:
        return None
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ValueError("response_format.json_schema is required when type is \"json_schema\"")
        return output_schema("json_schema", fmt.json_schema.schema_, fmt.json_schema.strict)
    return output_schema(fmt.type, None, None)
