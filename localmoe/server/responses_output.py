"""The Responses API's output side: output items (reasoning, message, function_call), the
response object, and the streaming event sequence built from a turn's deltas.

Streaming follows the documented order: `response.created`, `response.in_progress`, then per
item `response.output_item.added`, its content events (`response.content_part.added`,
`response.output_text.delta` ... `.done`, `response.content_part.done`; reasoning:
`response.reasoning_text.delta` ... `.done`; calls: `response.function_call_arguments.delta`
/ `.done`), `response.output_item.done`, and at the end `response.completed` (or
`response.incomplete` when `max_output_tokens` cut it) holding the same items.
"""

from __future__ import annotations

import uuid

from localmoe.chat.format import Delta, ToolCall
from localmoe.runtime.service import tool_call_dict


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, rid: str | None = None, status: str = "completed") -> dict:
    return {"id": rid or item_id("rs"), "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(text: str, mid: str | None = None, status: str = "completed") -> dict:
    return {"id": mid or item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [text_part(text)] if status == "completed" else []}


def arguments_of(call: ToolCall) -> str:
    """A call's arguments as the JSON text the API carries."""
    return tool_call_dict(call)["function"]["arguments"]


def call_item(call: ToolCall, arguments: str, status: str = "completed") -> dict:
    return {"id": item_id("fc"), "type": "function_call", "call_id": call.id, "name": call.name,
            "arguments": arguments if status == "completed" else "", "status": status}


def items_of(result) -> list[dict]:
    """A finished turn's output items: reasoning, the message, then the calls."""
    items = []
    if result.reasoning:
        items.append(reasoning_item(result.reasoning))
    if result.content or not result.tool_calls:
        items.append(message_item(result.content))
    items.extend(call_item(c, arguments_of(c)) for c in result.tool_calls)
    return items


def usage_of(result) -> dict:
    return {"input_tokens": result.prompt_tokens,
            "input_tokens_details": {"cached_tokens": result.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": result.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": result.reasoning_tokens},
            "total_tokens": result.prompt_tokens + result.completion_tokens}


class EventBuilder:
    """Turns a turn's deltas into Responses stream events and collects the output items."""

    def __init__(self):
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being streamed
        self._text = ""

    def delta(self, d: Delta) -> list[dict]:
        if d.tool_call is not None:
            events = self._close()
            index = len(self.items)
            arguments = arguments_of(d.tool_call)
            item = call_item(d.tool_call, arguments)
            added = {**item, "arguments": "", "status": "in_progress"}
            self.items.append(item)
            return events + [
                {"type": "response.output_item.added", "output_index": index, "item": added},
                {"type": "response.function_call_arguments.delta", "item_id": item["id"], "output_index": index,
                 "delta": arguments},
                {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": index,
                 "arguments": arguments},
                {"type": "response.output_item.done", "output_index": index, "item": item}]
        if not d.text:
            return []
        kind = "reasoning" if d.channel == "reasoning" else "message"
        events = [] if self._open is not None and self._open["type"] == kind else self._close() + self._start(kind)
        self._text += d.text
        index = len(self.items) - 1
        base = {"item_id": self._open["id"], "output_index": index, "content_index": 0, "delta": d.text}
        if kind == "reasoning":
            return events + [{"type": "response.reasoning_text.delta", **base}]
        return events + [{"type": "response.output_text.delta", **base, "logprobs": []}]

    def finish(self, result) -> list[dict]:
        """Close the open item; a turn that wrote nothing still answers with an (empty) message."""
        events = self._close()
        if not self.items or (not any(i["type"] == "message" for i in self.items) and not result.tool_calls):
            events += self._start("message") + self._close()
        return events

    def _start(self, kind: str) -> list[dict]:
        index = len(self.items)
        item = reasoning_item("", status="in_progress") if kind == "reasoning" else message_item("",
                                                                                               status="in_progress")
        self._open, self._text = item, ""
        self.items.append(item)
        events = [{"type": "response.output_item.added", "output_index": index, "item": dict(item)}]
        if kind == "message":
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                           "content_index": 0, "part": text_part("")})
        return events

    def _close(self) -> list[dict]:
        if self._open is None:
            return []
        item, text, index = self._open, self._text, len(self.items) - 1
        self._open = None
        base = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = reasoning_item(text, item["id"])
            events = [{"type": "response.reasoning_text.done", **base, "text": text}]
        else:
            done = message_item(text, item["id"])
            events = [{"type": "response.output_text.done", **base, "text": text, "logprobs": []},
                      {"type": "response.content_part.done", **base, "part": text_part(text)}]
        self.items[index] = done
        return events + [{"type": "response.output_item.done", "output_index": index, "item": done}]
