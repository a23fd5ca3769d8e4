"""Responses API pieces without a server: input items -> messages, unsupported fields, and the
stream's event order built from deltas."""

from __future__ import annotations

import pytest

from localmoe.chat import ChatFormatError, Delta, ToolCall, messages_from_openai
from localmoe.runtime.turn import TurnResult
from localmoe.server.responses_output import EventBuilder
from localmoe.server.responses_schemas import ResponsesRequest, input_messages


def test_items_become_chat_messages():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in "}, {"type": "input_text",
                                                                                     "text": "Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call."}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "18 C"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "9:00"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "18 C at 9:00."}]},
    ]
    messages = messages_from_openai(input_messages(items))
    assert [m.role for m in messages] == ["system", "user", "assistant", "tool", "tool", "assistant"]
    assert messages[1].content == "Weather in Paris?"
    assert messages[2].reasoning == "Call." and [(c.id, c.name, c.arguments) for c in messages[2].tool_calls] == [
        ("call_1", "get_weather", {"city": "Paris"}), ("call_2", "get_time", {})]
    assert [(m.tool_call_id, m.name, m.content) for m in messages[3:5]] == [
        ("call_1", "get_weather", "18 C"), ("call_2", "get_time", "9:00")]
    assert messages[5].content == "18 C at 9:00."
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("item, field", [
    ({"type": "item_reference", "id": "x"}, "input[0].type"),
    ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[0].content[0].type"),
    ({"type": "function_call", "name": "f", "arguments": "{}"}, "input[0].call_id"),
    ({"role": "tool", "content": "x"}, "input[0].role"),
])
def test_unreadable_items_name_the_field(item, field):
    with pytest.raises(ChatFormatError, match=field.replace("[", r"\[").replace("]", r"\]")):
        input_messages([item])


def test_unsupported_fields_are_named():
    body = ResponsesRequest(model="m", input="hi", background=True, conversation="c", top_logprobs=0,
                            truncation="disabled", include=["reasoning.encrypted_content"], service_tier="auto")
    assert body.unsupported() == ["background", "conversation"]
    assert ResponsesRequest(model="m", input="hi", top_logprobs=3, include=["x"]).unsupported() == [
        "include", "top_logprobs"]


def test_stream_events_open_and_close_each_item_in_order():
    builder = EventBuilder()
    events = []
    for d in (Delta("reasoning", "Hm"), Delta("reasoning", "m."), Delta("content", "It is "),
              Delta("content", "sunny."), Delta("tool_call", tool_call=ToolCall("get_weather", {"city": "Paris"}, "call_9"))):
        events += builder.delta(d)
    events += builder.finish(TurnResult(tool_calls=[ToolCall("get_weather", {}, "call_9")]))
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"]
    reasoning, message, call = builder.items
    assert reasoning["content"][0]["text"] == "Hmm." and message["content"][0]["text"] == "It is sunny."
    assert call["call_id"] == "call_9" and call["arguments"] == '{"city": "Paris"}'
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == builder.items
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2]


def test_a_turn_that_wrote_nothing_still_answers_with_a_message():
    builder = EventBuilder()
    events = builder.finish(TurnResult())
    assert [e["type"] for e in events] == ["response.output_item.added", "response.content_part.added",
                                          "response.output_text.done", "response.content_part.done",
                                          "response.output_item.done"]
    assert builder.items[0]["type"] == "message" and builder.items[0]["content"][0]["text"] == ""
