"""Request body of the OpenAI Responses API (`POST /v1/responses`) and its input items read
into chat messages. Fields the server cannot honour are refused by name (400), not ignored."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from localmoe.chat import ChatFormatError
from localmoe.chat.messages import content_text
from localmoe.server.schemas import Body, FunctionDecl, Sampling
from localmoe.server.structured import TextFormat

# accepted and ignored: they change nothing a local server does
IGNORED = {"safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"}
# accepted only at their "off" value
OFF = {"background": (False,), "top_logprobs": (0,), "truncation": ("disabled", "auto"),
       "include": ([], ["reasoning.encrypted_content"])}
REASONING_EFFORT = {"none": "low", "minimal": "low", "low": "low", "medium": "high", "high": "high",
                    "xhigh": "max", "max": "max"}  # Responses effort -> our thinking tier


class FunctionTool(FunctionDecl):
    """A function tool as the Responses API declares it: the chat API's fields, flat."""

    type: Literal["function"]


class NamedFunction(Body):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)


class ReasoningConfig(Body):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # accepted; reasoning comes back whole


class TextConfig(Body):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, not applied


class ResponsesRequest(Sampling):
    """`POST /v1/responses`. Sampling extensions (top_k, min_p, repetition_penalty, seed) as on chat."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=256)
    input: str | Annotated[list[dict[str, Any]], Field(max_length=10_000)]
    instructions: str | None = None
    tools: list[FunctionTool] | None = Field(default=None, max_length=256)
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool = True
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, pattern=r"^resp_[A-Za-z0-9]{1,64}$")
    store: bool = True
    max_output_tokens: int | None = Field(default=None, ge=1)
    metadata: dict[str, str] | None = None
    # accepted at their "off" value only (see OFF), or ignored (see IGNORED)
    background: bool | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    include: list[str] | None = None

    def unsupported(self) -> list[str]:
        """Names of fields set to something the server does not do."""
        names = [k for k, v in (self.model_extra or {}).items() if v is not None and k not in IGNORED]
        for name, allowed in OFF.items():
            value = getattr(self, name)
            if value is not None and value not in allowed:
                names.append(name)
        if self.n != 1:
            names.append("n")
        return sorted(names)


def _field(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise ChatFormatError(f"{where}.{key}: required, a non-empty string")
    return value


def input_messages(items: str | list[dict[str, Any]]) -> list[dict]:
    """Responses input -> OpenAI chat message dicts (function calls as assistant tool_calls,
    their outputs as tool messages, reasoning items as the next assistant turn's reasoning);
    ChatFormatError naming `input[i]...` for what cannot be read."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = (last.get("reasoning_content") or "") + "".join(reasoning)
            reasoning.clear()
        return last

    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise ChatFormatError(f"{where}.role: one of user, system, developer, assistant, not {role!r}")
            if role == "user":  # text and input_image parts, read by messages_from_openai
                content = item.get("content")
                for k, part in enumerate(content if isinstance(content, list) else []):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind not in ("text", "input_text", "output_text", "input_image"):
                        raise ChatFormatError(f"{where}.content[{k}].type: {kind!r} parts are not supported "
                                              f"(input_text, input_image)")
                messages.append({"role": role, "content": content})
                continue
            text = content_text(item.get("content"), f"{where}.content")
            if role == "assistant":
                message = assistant()
                message["content"] = (message.get("content") or "") + text
            else:
                messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {"id": _field(item, "call_id", where), "type": "function",
                    "function": {"name": _field(item, "name", where), "arguments": item.get("arguments") or "{}"}}
            message = assistant()
            message.setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _field(item, "call_id", where),
                             "content": content_text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            if not isinstance(parts, list):
                raise ChatFormatError(f"{where}.content: expected a list of reasoning_text parts")
            reasoning.extend(p.get("text", "") for p in parts if isinstance(p, dict))
        else:
            raise ChatFormatError(f"{where}.type: {kind!r} items are not supported (message, function_call, "
                             f"function_call_output, reasoning)")
    return messages
