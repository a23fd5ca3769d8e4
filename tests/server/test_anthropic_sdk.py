"""The Anthropic SDK against a real server on the embedded model."""

from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def client(real_server):
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(real_server):
    import httpx

    return httpx.get(real_server.url + "/v1/models").json()["data"][0]["id"]


def test_message_with_system(client, model_id):
    reply = client.messages.create(
        model=model_id,
        max_tokens=24,
        extra_body={"temperature": 0},
        system="Answer in one sentence.",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert reply.role == "assistant" and reply.type == "message"
    assert reply.content[0].type == "text" and reply.content[0].text.strip()
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= 24 and reply.usage.input_tokens > 0


def test_streaming_event_sequence(client, model_id):
    messages = [{"role": "user", "content": "Say hello."}]
    whole = client.messages.create(model=model_id, max_tokens=16, extra_body={"temperature": 0}, messages=messages)
    kinds, text = [], []
    with client.messages.stream(
        model=model_id, max_tokens=16, extra_body={"temperature": 0}, messages=messages
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                text.append(event.delta.text)
        final = stream.get_final_message()
    raw = [
        k
        for k in kinds
        if k
        in (
            "message_start",
            "content_block_start",
            "content_block_delta",
            "content_block_stop",
            "message_delta",
            "message_stop",
        )
    ]
    assert raw[0] == "message_start" and raw[1] == "content_block_start"
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "".join(text) == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason


def test_tool_use_round_trip(client, model_id):
    messages = [{"role": "user", "content": "What's the weather in Berlin?"}]
    first = client.messages.create(
        model=model_id,
        max_tokens=64,
        extra_body={"temperature": 0},
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    assert first.stop_reason == "tool_use"
    uses = [b for b in first.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input["city"], str)
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in first.content]},
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "12 degrees and raining"}],
        },
    ]
    final = client.messages.create(
        model=model_id,
        max_tokens=32,
        extra_body={"temperature": 0},
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "none"},
    )
    assert final.stop_reason in ("end_turn", "max_tokens")
    assert final.content[0].type == "text" and final.content[0].text.strip()
