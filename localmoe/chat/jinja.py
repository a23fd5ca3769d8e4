"""The chat format of every model without its own: the tokenizer's Jinja chat template.

Rendering passes the messages to the template as transformers does (`reasoning_content`,
`tool_calls` with `arguments` as an object, tool messages with `tool_call_id` and `name`),
plus `tools` and `reasoning_effort`; the text is encoded with special tokens matched, as
`apply_chat_template(tokenize=True)` does (so, as there, text that spells a special token
becomes that token).

Reading is by text: Hermes-style calls `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
(Qwen, SmolLM3, ...) become tool calls, and when the template uses `<think>` (`thinks`),
`<think>...</think>` is reasoning; when the generation prompt already opened `<think>`,
the reply starts in reasoning. Reasoning and content are stripped of surrounding
whitespace (a stream sends whitespace after text as it comes: its deltas may end in whitespace the reply drops). The text of a `<tool_call>` block that is not a JSON object with a name, or is
never closed, stays content without its tags: no tool markup ever reaches content.
A `<tool_response>` block is never the model's to write (small models echo the tool result
they were shown): a closed one is dropped, and so is a stray closing tag; the text of one
left open at the end is kept without its tag (a model that never closes it wrote its answer
there).
A template that shows no tools, tool calls or tool results (`native_tools` False, e.g.
SmolLM2-Instruct's) gets the conversation rewritten into that Hermes convention first
(chat/hermes_tools.py), so the model still sees its tools, calls and results.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from localmoe.chat.format import ChatMessage, Delta, ParsedReply, StreamParser, ToolCall
from localmoe.chat.hermes_tools import template_knows_tools, with_hermes_tools
from localmoe.chat.images import message_pieces, template_image_text
from localmoe.chat.validate import check_effort, check_messages, check_tools

THINK, END_THINK = "<think>", "</think>"
TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
TOOL_RESPONSE, END_TOOL_RESPONSE = "<tool_response>", "</tool_response>"


def template_call(call: ToolCall) -> dict:
    """A ToolCall as templates read it: arguments as an object (the model's own text when it was not one)."""
    arguments = call.arguments if call.raw_arguments is None else call.raw_arguments
    return {"type": "function", **({"id": call.id} if call.id else {}),
            "function": {"name": call.name, "arguments": arguments}}


def template_message(m: ChatMessage, image_text=None) -> dict:
    """A ChatMessage as the dict chat templates read (its images as `image_text(ref)` in the content)."""
    content = "".join(message_pieces(m, lambda ref: [image_text(ref)])) if m.images else m.content
    out: dict = {"role": m.role, "content": content}
    if m.reasoning is not None:
        out["reasoning_content"] = m.reasoning
    if m.tool_calls:
        out["tool_calls"] = [template_call(c) for c in m.tool_calls]
    if m.role == "tool":
        out.update({k: v for k, v in (("tool_call_id", m.tool_call_id), ("name", m.name)) if v is not None})
    return out


class JinjaFormat:
    """ChatFormat over a tokenizer's chat template (see the module docstring)."""

    name = "jinja"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.thinks = THINK in (tokenizer.chat_template or "")
        self.opens_thinking = self.thinks and self._prompt_opens_thinking()
        def render_text(messages, tools):
            return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)

        self.native_tools = template_knows_tools(render_text)

    def _prompt_opens_thinking(self) -> bool:
        """Whether the generation prompt ends inside `<think>` (DeepSeek-R1, Qwen3-Thinking templates)."""
        probe = [{"role": "user", "content": "Hi"}]
        try:
            text = self.tokenizer.apply_chat_template(probe, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - a template that rejects the probe just does not open it
            return False
        tail = text.rstrip()
        return tail.endswith(THINK) and END_THINK not in tail[tail.rfind(THINK):]

    def render(self, messages: Iterable[ChatMessage], *, tools: list[dict] | None = None,
               reasoning_effort: str | None = None, add_generation_prompt: bool = True) -> list[int]:
        """Prompt ids of the template's text (tools and reasoning_effort passed as variables)."""
        messages = check_messages(messages)
        tools = check_tools(tools) or None
        if not self.native_tools and (tools or any(m.role == "tool" or m.tool_calls for m in messages)):
            messages, tools = with_hermes_tools(messages, tools), None
        extra = {"reasoning_effort": check_effort(reasoning_effort)} if reasoning_effort else {}
        image_text = template_image_text(self.tokenizer) if any(m.images for m in messages) else None
        text = self.tokenizer.apply_chat_template([template_message(m, image_text) for m in messages],
                                                  add_generation_prompt=add_generation_prompt, tools=tools, **extra)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stop_token_ids(self) -> set[int]:
        """The tokenizer's end-of-generation ids."""
        return set(self.tokenizer.stop_token_ids)

    def end_of_thinking_ids(self) -> list[int]:
        """`</think>` and a blank line (empty when the template does not think)."""
        return self.tokenizer.encode("\n" + END_THINK + "\n\n", add_special_tokens=False) if self.thinks else []

    def _cut(self, token_ids: list[int]) -> list[int]:
        stops = self.tokenizer.stop_token_ids
        end = next((i for i, t in enumerate(token_ids) if t in stops), len(token_ids))
        return list(token_ids[:end])

    def parse(self, token_ids: list[int]) -> ParsedReply:
        """Reasoning, content and tool calls of generated ids (cut at the first stop id)."""
        reader = _TextReader(self.thinks, self.opens_thinking)
        reader.text(self.tokenizer.decode(self._cut(token_ids)))
        reader.finish()
        return reader.reply()

    def stream_parser(self) -> StreamParser:
        """A fresh incremental parser for one assistant turn."""
        return _Stream(self)


class _Stream:
    """Ids -> UTF-8-safe text -> _TextReader; ids after a stop id are ignored."""

    def __init__(self, fmt: JinjaFormat):
        self._stops = fmt.tokenizer.stop_token_ids
        self._decoder = fmt.tokenizer.stream_decoder()
        self._reader = _TextReader(fmt.thinks, fmt.opens_thinking)
        self._stopped = self._flushed = False

    def feed(self, token_id: int) -> list[Delta]:
        """Consume one generated token; return the deltas it completes."""
        if self._stopped or token_id in self._stops:
            self._stopped = True
            return []
        piece = self._decoder.feed(token_id)
        return self._reader.text(piece) if piece else []

    def flush(self) -> list[Delta]:
        """End of generation: the deltas still held back."""
        if self._flushed:
            return []
        self._flushed = self._stopped = True
        return self._reader.text(self._decoder.flush()) + self._reader.finish()

    def finish(self) -> ParsedReply:
        """End of generation: flush and return the whole reply."""
        self.flush()
        return self._reader.reply()


class _Stripped:
    """One channel's text, stripped at both ends: leading whitespace is dropped; whitespace after text is streamed
    as it comes (held until more text followed it, a newline token reached the client a step late, with the next
    token: a stutter, and the stream's longest gaps) but joins `text` (the reply) only once more text follows it.
    So the streamed deltas add up to `text` plus the channel's trailing whitespace, if any."""

    def __init__(self, channel: str):
        self.channel = channel
        self.text = ""
        self._pending = ""  # whitespace streamed after `text`, not in it (yet)

    def add(self, text: str) -> list[Delta]:
        if not self.text:
            text = text.lstrip()
        if not text:
            return []
        body = text.rstrip()
        if body:
            self.text += self._pending + body
            self._pending = text[len(body):]
        else:
            self._pending += text
        return [Delta(self.channel, text)]


def tool_call_from_json(body: str) -> ToolCall | None:
    """The call in a Hermes `<tool_call>` body, or None when it is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    call_id = obj["id"] if isinstance(obj.get("id"), str) else None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    raw = None
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments, raw = json.loads(arguments), arguments
        except ValueError:
            raw = arguments
    if not isinstance(arguments, dict):
        return ToolCall(name=obj["name"], arguments={}, id=call_id,
                        raw_arguments=raw if raw is not None else json.dumps(arguments, ensure_ascii=False))
    return ToolCall(name=obj["name"], arguments=arguments, id=call_id)


class _TextReader:
    """Splits decoded text on the think / tool-call markers, holding back a possible partial marker."""

    def __init__(self, thinks: bool, opens_thinking: bool):
        self._markers = {"content": ([THINK] if thinks else []) + [TOOL_CALL, TOOL_RESPONSE, END_TOOL_RESPONSE,
                                                                  END_TOOL_CALL],
                         "reasoning": [END_THINK, TOOL_RESPONSE, END_TOOL_RESPONSE], "tool": [END_TOOL_CALL],
                         "response": [END_TOOL_RESPONSE]}
        self._state = "reasoning" if opens_thinking else "content"
        self._before_response = self._state  # the state a dropped <tool_response> block returns to
        self._response: list[str] = []  # the text of an open <tool_response> block
        self._buffer = ""
        self._tool: list[str] = []
        self._content, self._reasoning = _Stripped("content"), _Stripped("reasoning")
        self._calls: list[ToolCall] = []

    def _emit(self, text: str) -> list[Delta]:
        if self._state == "response":
            self._response.append(text)
            return []
        if self._state == "tool":
            self._tool.append(text)
            return []
        return (self._reasoning if self._state == "reasoning" else self._content).add(text)

    def _switch(self, marker: str) -> list[Delta]:
        if marker == THINK:
            self._state = "reasoning"
        elif marker == TOOL_CALL:
            self._state, self._tool = "tool", []
        elif marker == END_THINK:
            self._state = "content"
        elif marker == TOOL_RESPONSE:
            self._before_response, self._state, self._response = self._state, "response", []
        elif marker == END_TOOL_RESPONSE:
            if self._state == "response":
                self._state = self._before_response
        elif self._state != "tool":  # a stray </tool_call>: dropped
            pass
        else:  # END_TOOL_CALL
            self._state = "content"
            body = "".join(self._tool)
            call = tool_call_from_json(body.strip())
            if call is None:  # not a call after all: the text stays, the markup goes
                return self._content.add(body)
            self._calls.append(call)
            return [Delta("tool", tool_call=call)]
        return []

    def text(self, text: str) -> list[Delta]:
        self._buffer += text
        deltas: list[Delta] = []
        while True:
            markers = self._markers[self._state]
            found = [(self._buffer.find(m), m) for m in markers if m in self._buffer]
            if not found:
                break
            at, marker = min(found)
            deltas += self._emit(self._buffer[:at])
            self._buffer = self._buffer[at + len(marker):]
            deltas += self._switch(marker)
        keep = max((k for m in markers for k in range(1, len(m)) if self._buffer.endswith(m[:k])), default=0)
        deltas += self._emit(self._buffer[:len(self._buffer) - keep])
        self._buffer = self._buffer[len(self._buffer) - keep:]
        return [d for d in deltas if d.text or d.tool_call]

    def finish(self) -> list[Delta]:
        """End of text: what was held back, and the text of an unclosed `<tool_call>` as content."""
        rest, self._buffer = self._buffer, ""
        deltas = self._emit(rest)
        if self._state == "response":  # never closed: its text is the answer
            self._state = self._before_response
            deltas += self._emit("".join(self._response))
        if self._state == "tool":
            self._state = "content"
            deltas += self._content.add("".join(self._tool))
        return deltas

    def reply(self) -> ParsedReply:
        return ParsedReply(content=self._content.text, reasoning=self._reasoning.text, tool_calls=list(self._calls))
