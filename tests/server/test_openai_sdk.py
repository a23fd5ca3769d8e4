"""The OpenAI SDK against a real server on the embedded model (SmolLM2-135M-Instruct)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "utc_offset": {"type": "integer"}},
                   "required": ["city", "utc_offset"]}}}


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


def test_models_lists_the_served_model(client, real_server):
    models = client.models.list().data
    assert len(models) == 1 and models[0].owned_by == "localmoe"


def test_chat_answers_and_counts_usage(client, model_id):
    reply = client.chat.completions.create(model=model_id, temperature=0, max_tokens=24,
                                           messages=[{"role": "user", "content": "What is the capital of France?"}])
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 24
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0  # SmolLM2's template does not think


def test_streaming_equals_the_whole_answer(client, model_id):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(model=model_id, temperature=0, max_tokens=20, messages=messages)
    parts, finish, usage = [], None, None
    stream = client.chat.completions.create(model=model_id, temperature=0, max_tokens=20, messages=messages,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            parts.append(choice.delta.content or "")
            finish = choice.finish_reason or finish
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    assert usage is not None and usage.completion_tokens == whole.usage.completion_tokens


def test_forced_tool_call_round_trip(client, model_id):
    messages = [{"role": "user", "content": "What's the weather like in Paris today?"}]
    first = client.chat.completions.create(model=model_id, temperature=0, max_tokens=64, messages=messages,
                                           tools=[WEATHER, TIME],
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id
    arguments = json.loads(call.function.arguments)
    assert isinstance(arguments["city"], str) and arguments["unit"] in ("celsius", "fahrenheit")
    assert set(arguments) <= {"city", "unit"}

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "sky": "sunny"})}]
    final = client.chat.completions.create(model=model_id, temperature=0, max_tokens=32, messages=messages,
                                           tools=[WEATHER, TIME], tool_choice="none")
    assert final.choices[0].finish_reason in ("stop", "length")
    assert final.choices[0].message.content.strip()
    assert not final.choices[0].message.tool_calls


def test_required_tool_choice_picks_a_declared_tool(client, model_id):
    reply = client.chat.completions.create(
        model=model_id, temperature=0, max_tokens=64, tools=[WEATHER, TIME], tool_choice="required",
        messages=[{"role": "user", "content": "What time is it in Tokyo?"}])
    (call,) = reply.choices[0].message.tool_calls
    schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
    arguments = json.loads(call.function.arguments)
    assert set(schema["required"]) <= set(arguments) <= set(schema["properties"])


def test_forced_tool_call_streams_one_tool_call(client, model_id):
    stream = client.chat.completions.create(
        model=model_id, temperature=0, max_tokens=64, tools=[WEATHER], stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        messages=[{"role": "user", "content": "Weather in Rome?"}])
    calls, finish = [], None
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and len(calls) == 1
    assert calls[0].function.name == "get_weather" and "city" in json.loads(calls[0].function.arguments)


def test_completions_endpoint(client, model_id):
    reply = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=8,
                                      temperature=0)
    assert reply.choices[0].text and reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=model_id, prompt="The capital of France is", max_tokens=8, temperature=0, stream=True) if c.choices)
    assert streamed == reply.choices[0].text


def test_stop_string_cuts_the_answer(client, model_id):
    messages = [{"role": "user", "content": "Count from one to ten in words."}]
    free = client.chat.completions.create(model=model_id, temperature=0, max_tokens=40, messages=messages)
    text = free.choices[0].message.content
    assert len(text) >= 8, text
    stop = text[len(text) // 2:len(text) // 2 + 3]  # a stop string from the middle of the free answer
    cut = client.chat.completions.create(model=model_id, temperature=0, max_tokens=40, messages=messages,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_the_next_turn_reuses_the_cached_prefix(client, model_id):
    """The second turn's prompt starts with the first turn's prompt and reply: the server's prefix cache
    serves the first turn's prompt up to a prefill-chunk boundary (the template's system header, then
    512-position chunks), and usage.prompt_tokens_details.cached_tokens says how many; the first turn
    could reuse at most that header (left by an earlier request)."""
    from localmoe.engine.generate import PREFILL_CHUNK

    document = " ".join(f"Fact {i}: the {i}th planet of the test system is called P{i}." for i in range(60))
    messages = [{"role": "user", "content": document + "\nWhich planet is the 7th?"}]
    first = client.chat.completions.create(model=model_id, temperature=0, max_tokens=8, messages=messages)
    assert first.usage.prompt_tokens > PREFILL_CHUNK and first.usage.prompt_tokens_details.cached_tokens < 64
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And the 8th?"}]
    second = client.chat.completions.create(model=model_id, temperature=0, max_tokens=8, messages=messages)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - PREFILL_CHUNK < cached <= first.usage.prompt_tokens  # all but the last chunk
