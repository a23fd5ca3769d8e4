"""Tools for chat templates that know none (SmolLM2-Instruct, Llama 2, many fine-tunes).

Such a template drops the `tools` variable and an assistant message's `tool_calls`, and
renders a tool result as a message of an unknown role, so the model would never see its
tools, its own calls or their results. For them the conversation is rewritten before the
template runs, into the Hermes convention the Jinja parser already reads:
- the tool declarations (one JSON object per line inside `<tools>`) and how to call them
  go into the system message (a new one when there is none);
- an assistant message's calls are appended to its content as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- tool results become one user message of `<tool_response>` blocks per run of results.
The parser then reads the model's calls, and a forced `tool_choice` finds the call's
opening in the rendered text, so forced calls are written in the same convention.
"""

from __future__ import annotations

import json

from localmoe.chat.format import ChatMessage, ToolCall

TOOLS_PREAMBLE = (
    "You can call functions (tools) to help with the user's request. Their signatures, one JSON "
    "object per line:\n<tools>\n{declarations}\n</tools>\n\n"
    "To call one, answer with a JSON object holding its name and arguments inside <tool_call></tool_call> "
    'tags:\n<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n</tool_call>\n'
    "The results come back inside <tool_response></tool_response> tags."
)


def tools_system_text(tools: list[dict]) -> str:
    return TOOLS_PREAMBLE.format(declarations="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))


def call_text(call: ToolCall) -> str:
    arguments = call.raw_arguments if call.raw_arguments is not None else json.dumps(call.arguments,
                                                                                        ensure_ascii=False)
    return f'<tool_call>\n{{"name": {json.dumps(call.name, ensure_ascii=False)}, "arguments": {arguments}}}\n</tool_call>'


def with_hermes_tools(messages: list[ChatMessage], tools: list[dict] | None) -> list[ChatMessage]:
    """`messages` rewritten for a template without tool support (see the module docstring)."""
    out: list[ChatMessage] = []
    if tools:
        declared = tools_system_text(tools)
        if messages and messages[0].role == "system":
            first = messages[0]
            messages = [ChatMessage("system", f"{first.content}\n\n{declared}" if first.content else declared),
                        *messages[1:]]
        else:
            messages = [ChatMessage("system", declared), *messages]
    for m in messages:
        if m.role == "assistant" and m.tool_calls:
            calls = "\n".join(call_text(c) for c in m.tool_calls)
            out.append(ChatMessage("assistant", f"{m.content}\n{calls}" if m.content else calls, reasoning=m.reasoning))
        elif m.role == "tool":
            block = f"<tool_response>\n{m.content}\n</tool_response>"
            if out and out[-1].role == "user" and out[-1].content.endswith("</tool_response>"):
                out[-1] = ChatMessage("user", f"{out[-1].content}\n{block}")
            else:
                out.append(ChatMessage("user", block))
        else:
            out.append(m)
    return out


def template_knows_tools(render_text) -> bool:
    """Whether a template shows tool declarations, assistant tool calls and tool results.

    `render_text(messages: list[dict], tools: list[dict] | None) -> str` renders with the template;
    a probe name that does not come out in the text means the template drops that part.
    """
    probe = "zzprobe_tool"
    tools = [{"type": "function", "function": {"name": probe + "_declared", "parameters": {"type": "object"}}}]
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "id": "c1", "function": {"name": probe + "_called", "arguments": {}}}]},
                {"role": "tool", "content": probe + "_result", "tool_call_id": "c1", "name": probe + "_called"}]
    try:
        text = render_text(messages, tools)
    except Exception:  # noqa: BLE001 - a template that rejects the probe does not know tools
        return False
    return all(probe + part in text for part in ("_declared", "_called", "_result"))
