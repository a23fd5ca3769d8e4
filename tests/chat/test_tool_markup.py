"""Tool-call and tool-response markup never reaches content, in every chat format, parsed at
once or streamed: a model that writes a tool result itself (small models echo the one they
were shown) has that block dropped, and its answer is what is left."""

from __future__ import annotations

import pytest

from localmoe.chat.format import ToolCall
from localmoe.chat.harmony import HarmonyFormat
from localmoe.chat.jinja import JinjaFormat
from localmoe.chat.xtml import XtmlFormat

RESULT = '{"temperature_c": 18, "sky": "cloudy"}'
MARKUP = ("<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>", "temperature_c", "<|", "|>")


def clean(text: str) -> bool:
    return not any(m in text for m in MARKUP)


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer):
    return JinjaFormat(smollm2_tokenizer)


@pytest.mark.parametrize("text, content", [
    ("<tool_response>\nIt is 18 °C.", "It is 18 °C."),  # left open: the model's answer, without the tag
    (f"<tool_response>{RESULT}</tool_response>\nIt is 18 °C and cloudy.", "It is 18 °C and cloudy."),
    (f"It is 18 °C.\n<tool_response>\n{RESULT}\n</tool_response>", "It is 18 °C."),
    ("Sure.</tool_response> Done.</tool_call>", "Sure. Done."),
    (f'<tool_response>{RESULT}</tool_response><tool_call>{{"name": "f", "arguments": {{}}}}</tool_call>', ""),
], ids=["left-open", "echo-then-answer", "answer-then-echo", "stray-closers", "echo-then-call"])
def test_hermes_tool_response_is_dropped(smol, smollm2_tokenizer, stream, text, content):
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    reply = smol.parse(ids)
    assert reply.content == content and clean(reply.content)
    deltas, streamed = stream(smol, ids)  # also checks the deltas add up to the reply
    assert streamed == reply and all(clean(d.text) for d in deltas)
    if "<tool_call>" in text:
        assert reply.tool_calls == [ToolCall("f", {})]


def test_harmony_tool_message_written_by_the_model_is_dropped(gpt_oss_tokenizer, stream):
    fmt = HarmonyFormat(gpt_oss_tokenizer)
    p, ids = fmt.pieces, fmt.ids
    s, c, m, e = ids["<|start|>"], ids["<|channel|>"], ids["<|message|>"], ids["<|end|>"]
    tokens = p.build([c, "final", m, "Checking.", e, s, "functions.get_weather to=assistant", c, "commentary", m,
                      RESULT, e, s, "assistant", c, "final", m, "It is 18 °C.", ids["<|return|>"]])
    reply = fmt.parse(tokens)
    assert reply.content == "Checking.It is 18 °C." and clean(reply.content)
    _, streamed = stream(fmt, tokens)
    assert streamed == reply


def test_xtml_message_written_by_the_model_ends_the_turn(k3_tokenizer, stream):
    fmt = XtmlFormat(k3_tokenizer)
    o, c, s = fmt.open, fmt.close, fmt.sep
    tokens = fmt.pieces.build([c, "think", s, o, "response", s, "It is 18 °C.", c, "response", s,
                               o, 'message role="tool" tool="get_weather" index="1"', s, o, "response", s, RESULT,
                               c, "response", s, c, "message", s])
    reply = fmt.parse(tokens)
    assert reply.content == "It is 18 °C." and clean(reply.content)
    _, streamed = stream(fmt, tokens)
    assert streamed == reply
