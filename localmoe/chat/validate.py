"""Checks every format runs before rendering: each error names the message index and field."""

from __future__ import annotations

from collections.abc import Iterable

from localmoe.chat.format import REASONING_EFFORTS, ROLES, ChatFormatError, ChatMessage, ToolCall


def check_messages(messages: Iterable[ChatMessage]) -> list[ChatMessage]:
    """The messages as a list, after checking roles and field types."""
    checked = list(messages)
    for i, m in enumerate(checked):
        where = f"messages[{i}]"
        if not isinstance(m, ChatMessage):
            raise ChatFormatError(f"{where}: expected a ChatMessage, got {type(m).__name__} "
                                  f"(convert OpenAI-style dicts with messages_from_openai)")
        if m.role not in ROLES:
            raise ChatFormatError(f"{where}.role: {m.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(m.content, str):
            raise ChatFormatError(f"{where}.content: expected text, got {type(m.content).__name__}")
        if m.reasoning is not None and not isinstance(m.reasoning, str):
            raise ChatFormatError(f"{where}.reasoning: expected text or None, got {type(m.reasoning).__name__}")
        if m.tool_calls and m.role != "assistant":
            raise ChatFormatError(f"{where}.tool_calls: only assistant messages carry tool calls, not {m.role!r}")
        if m.images and m.role != "user":
            raise ChatFormatError(f"{where}.images: only user messages carry images, not {m.role!r}")
        if any(not 0 <= ref.offset <= len(m.content) for ref in m.images):
            raise ChatFormatError(f"{where}.images: an image's offset lies outside the message's text")
        for j, call in enumerate(m.tool_calls):
            if not isinstance(call, ToolCall):
                raise ChatFormatError(f"{where}.tool_calls[{j}]: expected a ToolCall, got {type(call).__name__}")
            if not isinstance(call.name, str) or not call.name:
                raise ChatFormatError(f"{where}.tool_calls[{j}].name: a tool call needs a function name")
            if not isinstance(call.arguments, dict):
                raise ChatFormatError(f"{where}.tool_calls[{j}].arguments: expected a JSON object (dict), "
                                      f"got {type(call.arguments).__name__}")
    return checked


def check_tools(tools: list[dict] | None) -> list[dict]:
    """OpenAI-style function declarations, checked: each needs `function.name`."""
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise ChatFormatError(f"tools: expected a list of function declarations, got {type(tools).__name__}")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict):
            raise ChatFormatError(f"tools[{i}].function: expected an object "
                                  '({"type": "function", "function": {"name": ..., "parameters": ...}})')
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise ChatFormatError(f"tools[{i}].function.name: a tool needs a name")
    return tools


def check_effort(effort: str | None) -> str | None:
    """`effort` itself when it is None or one of REASONING_EFFORTS."""
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ChatFormatError(f"reasoning_effort: {effort!r} is not one of {', '.join(REASONING_EFFORTS)}")
    return effort


def tool_result_names(messages: list[ChatMessage]) -> list[tuple[str, int]]:
    """(function name, 1-based index among the calls it answers) for each tool message, in order.

    A tool message answers the call of the latest assistant message whose id is its
    `tool_call_id`; without a matching id, the next call in order. Its own `name` wins.
    """
    out: list[tuple[str, int]] = []
    calls: list[ToolCall] = []
    position = 0
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls, position = m.tool_calls, 0
        elif m.role == "tool":
            position += 1
            index = next((k + 1 for k, c in enumerate(calls) if m.tool_call_id and c.id == m.tool_call_id), position)
            name = m.name or (calls[index - 1].name if index <= len(calls) else "")
            out.append((name, index))
    return out

