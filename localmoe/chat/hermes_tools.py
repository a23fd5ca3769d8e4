"""Tools for chat templates that know none (SmolLM2-Instruct, Llama 2, many fine-tunes).

Such a template drops the `tools` variable and an assistant message's `tool_calls`, and
renders a tool result as a message of an unknown role, so the model would never see its
tools, its own calls or their results. For them the conversation is rewritten before the
template runs, into the Hermes convention the Jinja parser already reads:
- the tool declarations (one JSON object per line inside `<tools>`) and how to call them
  go into the system message (a new one when there is none);
- an assistant message's calls are appended to its content as
  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` blocks;
- each run of tool results becomes one user message: "The f tool returned: ..." per result,
  then a request to answer with them. Small models echo results shown as `<tool_response>`
  blocks instead of answering: SmolLM2-135M, greedy, over 5 conversations with the tools
  declared and 5 without, answered without markup in 10 of 10 this way, against 6 of 10 as
  tool-role messages and 1 of 10 as `<tool_response>` blocks (the reply parser drops such
  closed blocks and the tags of open ones, so markup never reaches content either way).
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
    "The results come back in a user message that names the tool."
)
ASK = "Using {what}, answer my question in a sentence."


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
    results: list[str] = []  # the run of tool results being collected
    called = {c.id: c.name for m in messages for c in m.tool_calls if c.id}  # a result's tool, by call id

    def close_results() -> None:
        if results:
            what = "this result" if len(results) == 1 else "these results"
            out.append(ChatMessage("user", "\n".join(results) + "\n" + ASK.format(what=what)))
            results.clear()

    for m in messages:
        if m.role != "tool":
            close_results()
        if m.role == "assistant" and m.tool_calls:
            calls = "\n".join(call_text(c) for c in m.tool_calls)
            out.append(ChatMessage("assistant", f"{m.content}\n{calls}" if m.content else calls, reasoning=m.reasoning))
        elif m.role == "tool":
            name = m.name or called.get(m.tool_call_id or "") or "called"
            results.append(f"The {name} tool returned: {m.content}")
            continue
        else:
            out.append(m)
    close_results()
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
