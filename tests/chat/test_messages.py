"""OpenAI-style dicts -> ChatMessages, and picking a format by family."""

from types import SimpleNamespace

import pytest

from localmoe.chat import (
    ChatFormatError,
    ChatMessage,
    HarmonyFormat,
    JinjaFormat,
    ToolCall,
    XtmlFormat,
    chat_format_for,
    messages_from_openai,
)
from localmoe.errors import LocalMoEError


def test_conversion():
    messages = messages_from_openai([
        {"role": "developer", "content": "Be kind."},
        {"role": "user", "content": [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "reasoning_content": "think",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": [1, "é"]}'}},
                        {"id": "c2", "type": "function", "function": {"name": "g", "arguments": ""}}]},
        {"role": "tool", "tool_call_id": "c2", "content": "ok"},
        {"role": "tool", "tool_call_id": "c1", "name": "explicit", "content": "done"},
        {"role": "assistant", "content": "Bye", "reasoning": "alias"},
    ])
    assert messages == [
        ChatMessage("system", "Be kind."),
        ChatMessage("user", "Hello there"),
        ChatMessage("assistant", "", reasoning="think",
                    tool_calls=[ToolCall("f", {"a": [1, "é"]}, id="c1"), ToolCall("g", {}, id="c2")]),
        ChatMessage("tool", "ok", name="g", tool_call_id="c2"),
        ChatMessage("tool", "done", name="explicit", tool_call_id="c1"),
        ChatMessage("assistant", "Bye", reasoning="alias"),
    ]


@pytest.mark.parametrize("messages,where", [
    ({"role": "user"}, r"^messages: expected a list"),
    (["hi"], r"^messages\[0\]: expected an object"),
    ([{"role": "user", "content": "x"}, {"role": "robot"}], r"^messages\[1\]\.role: 'robot'"),
    ([{"content": "x"}], r"^messages\[0\]\.role: None"),
    ([{"role": "user", "content": 3}], r"^messages\[0\]\.content: expected a string"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], r"^messages\[0\]\.content\[0\]\.type: only text"),
    ([{"role": "assistant", "tool_calls": {"a": 1}}], r"^messages\[0\]\.tool_calls: expected a list"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.function\.name"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{bad"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: not valid JSON"),
    ([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "[1]"}}]}],
     r"^messages\[0\]\.tool_calls\[0\]\.function\.arguments: expected a JSON object"),
    ([{"role": "user", "content": "x"}, {"role": "user", "content": "y", "tool_calls": [{}]}],
     r"^messages\[1\]\.tool_calls: only assistant"),
    ([{"role": "tool", "content": "x", "tool_call_id": 7}], r"^messages\[0\]\.tool_call_id: expected a string"),
    ([{"role": "assistant", "reasoning_content": ["x"]}], r"^messages\[0\]\.reasoning_content: expected a string"),
])
def test_errors_name_index_and_field(messages, where):
    with pytest.raises(ChatFormatError, match=where) as info:
        messages_from_openai(messages)
    assert isinstance(info.value, LocalMoEError)


def test_chat_format_for(k3_tokenizer, gpt_oss_tokenizer, smollm2_tokenizer):
    assert isinstance(chat_format_for(SimpleNamespace(family="kimi_k3"), k3_tokenizer), XtmlFormat)
    assert isinstance(chat_format_for(SimpleNamespace(family="gpt_oss"), gpt_oss_tokenizer), HarmonyFormat)
    assert isinstance(chat_format_for(SimpleNamespace(family="llama"), smollm2_tokenizer), JinjaFormat)
    assert isinstance(chat_format_for("qwen3_next", smollm2_tokenizer), JinjaFormat)


def test_missing_special_token_is_a_clear_error(smollm2_tokenizer):
    with pytest.raises(LocalMoEError, match=r"XTML chat format needs the special token '<\|open\|>'"):
        XtmlFormat(smollm2_tokenizer)
