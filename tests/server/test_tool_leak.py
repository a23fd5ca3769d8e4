"""After a tool result, the answer is the model's answer: no `<tool_response>` echo and no
tool markup, through the openai and anthropic SDKs (streamed and not) on the embedded
SmolLM2, which answers greedily with an echo of the result it was shown; and through the
conversation loop the TUI and web app share."""

from __future__ import annotations

import json

import anthropic
import openai
import pytest

RESULT = {"temperature_c": 18, "sky": "cloudy"}
MARKUP = ("<tool_response>", "</tool_response>", "<tool_call>", "</tool_call>")
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
MESSAGES = [{"role": "user", "content": "What's the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                "name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": json.dumps(RESULT)}]


def clean(text: str | None) -> bool:
    return not any(m in (text or "") for m in MARKUP) and json.dumps(RESULT) not in (text or "")


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="none", max_retries=0)


def test_openai_answer_after_a_tool_result_has_no_markup(client):
    settings = [{"temperature": 0}] + [{"temperature": 0.7, "seed": seed} for seed in range(4)]
    for extra in settings:
        reply = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=48,
                                               **extra)
        assert clean(reply.choices[0].message.content), (extra, reply.choices[0].message.content)
        chunks = client.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, max_tokens=48,
                                                stream=True, **extra)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert clean(streamed) and streamed == (reply.choices[0].message.content or ""), extra


def test_anthropic_answer_after_a_tool_result_has_no_markup(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "What's the weather in Paris?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                   "input": {"city": "Paris"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": json.dumps(RESULT)}]}]
    tools = [{"name": "get_weather", "description": "Weather for a city",
              "input_schema": TOOLS[0]["function"]["parameters"]}]
    reply = client.messages.create(model="default", max_tokens=48, messages=messages, tools=tools,
                                   extra_body={"temperature": 0})
    texts = [b.text for b in reply.content if b.type == "text"]
    assert all(clean(t) for t in texts), texts
    with client.messages.stream(model="default", max_tokens=48, messages=messages, tools=tools,
                                extra_body={"temperature": 0}) as stream:
        streamed = "".join(stream.text_stream)
    assert clean(streamed) and streamed == "".join(texts)


def test_conversation_loop_answer_after_a_tool_result_has_no_markup(tmp_path):
    """The TUI's and web app's loop: the model calls read_file (forced), the result goes back, the answer is clean."""
    import asyncio

    from localmoe.ui.conversation import Conversation

    from localmoe.config import EngineConfig
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service

    (tmp_path / "weather.json").write_text(json.dumps(RESULT))
    service = Service(load_model(None, EngineConfig(threads=1), progress=False), ServerConfig(threads=1))
    service.start()
    try:
        conversation = Conversation(service, workdir=tmp_path, max_tokens=40, params=SamplingParams(temperature=0))
        conversation.tool_choice = "read_file"

        async def approve(call):
            return True

        async def run():
            return [e async for e in conversation.send("Read weather.json and tell me the weather.", approve)]

        events = asyncio.run(run())
    finally:
        service.stop()
    assert any(e.kind == "tool_result" and e.approved for e in events)
    answer = "".join(e.text for e in events if e.kind == "content")
    turns = [e.turn for e in events if e.kind == "turn_done"]
    assert len(turns) >= 2 and clean(answer) and all(clean(t.content) for t in turns), answer
