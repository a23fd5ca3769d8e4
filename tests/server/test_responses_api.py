"""The OpenAI Responses API (`/v1/responses`) with the official SDK and LangChain over a real
server on the embedded model (SmolLM2-135M-Instruct, sessions on)."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_text_input_and_instructions(client):
    reply = client.responses.create(model="default", input="What is the capital of France?",
                                    instructions="Answer in one short sentence.", temperature=0,
                                    max_output_tokens=24)
    assert reply.object == "response" and reply.id.startswith("resp_")
    assert reply.status in ("completed", "incomplete")
    (message,) = [item for item in reply.output if item.type == "message"]
    assert message.role == "assistant" and message.content[0].type == "output_text"
    assert reply.output_text.strip() and reply.output_text == message.content[0].text
    assert reply.usage.input_tokens > 0 and 0 < reply.usage.output_tokens <= 24
    assert client.responses.retrieve(reply.id).output_text == reply.output_text


def test_message_items_give_the_same_answer_as_text(client):
    as_text = client.responses.create(model="default", input="Name a colour.", temperature=0, max_output_tokens=12)
    as_items = client.responses.create(model="default", temperature=0, max_output_tokens=12, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]}])
    assert as_items.output_text == as_text.output_text


def test_stream_follows_the_documented_event_sequence(client):
    with client.responses.stream(model="default", input="Say hello.", temperature=0, max_output_tokens=200) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas and deltas == final.output_text
    whole = client.responses.create(model="default", input="Say hello.", temperature=0, max_output_tokens=200)
    assert whole.output_text == final.output_text


def test_cut_stream_ends_with_response_incomplete(client):
    with client.responses.stream(model="default", input="Tell a long story.", temperature=0,
                                 max_output_tokens=4) as stream:
        events = list(stream)
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"


def test_two_turn_function_call_round_trip(client, real_server):
    import httpx

    first = client.responses.create(model="default", input="What's the weather in Paris?", tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"}, temperature=0.7,
                                    max_output_tokens=64)
    (call,) = [item for item in first.output if item.type == "function_call"]
    arguments = json.loads(call.arguments)
    jsonschema.validate(arguments, WEATHER["parameters"])
    assert call.name == "get_weather" and call.call_id
    second = client.responses.create(
        model="default", tools=[WEATHER], temperature=0, max_output_tokens=32,
        input=[{"role": "user", "content": "What's the weather in Paris?"}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 18, "sky": "sunny"})}])
    assert second.status in ("completed", "incomplete") and "<tool_response>" not in second.output_text
    assert [item.type for item in second.output] == ["message"]
    stored = httpx.get(f"{real_server.url}/v1/sessions/{second.id}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[1]["tool_calls"][0]["name"] == "get_weather"
    assert stored[1]["tool_calls"][0]["arguments"] == arguments
    assert json.loads(stored[2]["content"]) == {"temperature_c": 18, "sky": "sunny"}
    # the same through previous_response_id: only the output is sent, the call comes from the stored response
    third = client.responses.create(model="default", tools=[WEATHER], temperature=0, max_output_tokens=32,
                                    previous_response_id=first.id, input=[
                                        {"type": "function_call_output", "call_id": call.call_id,
                                         "output": json.dumps({"temperature_c": 18, "sky": "sunny"})}])
    assert third.output_text == second.output_text
    stored = httpx.get(f"{real_server.url}/v1/sessions/{third.id}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "tool", "assistant"]
    assert stored[2]["name"] == "get_weather"


def test_previous_response_id_continues_the_conversation(client, real_server):
    import httpx

    first = client.responses.create(model="default", input="My name is Ada.", temperature=0, max_output_tokens=16)
    second = client.responses.create(model="default", input="What is my name?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # the history came along
    stored = httpx.get(f"{real_server.url}/v1/sessions/{second.id}").json()["messages"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[0]["content"] == "My name is Ada." and stored[1]["content"] == first.output_text
    unstored = client.responses.create(model="default", input="hi", store=False, max_output_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="default", input="hi", previous_response_id=unstored.id)
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)


def test_json_schema_text_format_validates(client):
    for seed in range(5):
        reply = client.responses.create(
            model="default", input="Describe a person.", temperature=0.7, max_output_tokens=120,
            extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        assert reply.status == "completed"
        jsonschema.validate(json.loads(reply.output_text), PERSON)


def test_parse_helper_returns_the_pydantic_object(client):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    reply = client.responses.parse(model="default", input="Describe a person.", text_format=Person,
                                   temperature=0.7, max_output_tokens=120)
    assert isinstance(reply.output_parsed, Person)


def test_reasoning_effort_is_accepted_and_unsupported_fields_are_named(client):
    reply = client.responses.create(model="default", input="Hi", reasoning={"effort": "low"}, max_output_tokens=4)
    assert reply.reasoning.effort == "low"
    for kwargs, field in (({"background": True}, "background"),
                          ({"extra_body": {"conversation": "c1"}}, "conversation"),
                          ({"tools": [{"type": "web_search"}]}, "tools"),
                          ({"input": [{"type": "item_reference", "id": "x"}]}, "item_reference")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="default", **{"input": "hi", **kwargs})
        assert field in str(e.value)


def test_langchain_structured_output_and_responses_api(real_server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city."""

        name: str = Field(max_length=24)
        population: int = Field(ge=0, le=10**8)

    llm = ChatOpenAI(base_url=real_server.url + "/v1", api_key="unused", model="default", temperature=0.7,
                     max_tokens=120, max_retries=0)
    city = llm.with_structured_output(City).invoke("Name a city and its population.")  # json_schema by default
    assert isinstance(city, City)
    responses = ChatOpenAI(base_url=real_server.url + "/v1", api_key="unused", model="default", temperature=0,
                           max_tokens=24, max_retries=0, use_responses_api=True)
    answer = responses.invoke("What is the capital of France?")
    assert answer.text.strip()
    structured = responses.with_structured_output(City).invoke("Name a city and its population.")
    assert isinstance(structured, City)


def test_bodies_and_events_validate_against_the_sdk_types(real_server):
    """The SDK parses leniently; validate strictly against its pydantic types instead."""
    import httpx
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": "default", "input": "What's the weather in Paris?", "max_output_tokens": 48,
            "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}, "reasoning": {
                "effort": "low"}, "metadata": {"k": "v"}}
    reply = httpx.post(f"{real_server.url}/v1/responses", json=body, timeout=300).json()
    response = Response.model_validate(reply)
    assert [item.type for item in response.output] == ["function_call"]
    events = TypeAdapter(ResponseStreamEvent)
    seen = []
    with httpx.stream("POST", f"{real_server.url}/v1/responses", json={**body, "stream": True, "tools": None,
                                                                          "tool_choice": None}, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen.append(events.validate_json(line[len("data: "):]).type)
    assert seen[0] == "response.created" and seen[-1] in ("response.completed", "response.incomplete")
    stored = httpx.get(f"{real_server.url}/v1/responses/{response.id}", timeout=30).json()
    assert Response.model_validate(stored).id == response.id


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory):
    """A tiny random Kimi K3 (XTML: the prompt opens the reasoning) with small thinking budgets."""
    from localmoe.testing import write_checkpoint
    from tests.server.conftest import start_server

    model = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3"), "tiny", seed=0)
    server = start_server(model, tmp_path_factory.mktemp("k3-logs"), "--max-context", "512", "--sessions",
                          str(tmp_path_factory.mktemp("k3-db") / "s.db"), "--thinking-budgets",
                          "low=4,high=8,max=12")
    yield server
    server.stop()


def test_reasoning_comes_back_as_a_reasoning_item(thinking_server):
    client = openai.OpenAI(base_url=thinking_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    reply = client.responses.create(model="default", input="Why is the sky blue?", reasoning={"effort": "low"},
                                    temperature=0, max_output_tokens=40)
    kinds = [item.type for item in reply.output]
    assert kinds[0] == "reasoning" and "message" in kinds
    reasoning = reply.output[0]
    assert reasoning.content[0].type == "reasoning_text" and reasoning.content[0].text
    assert 0 < reply.usage.output_tokens_details.reasoning_tokens <= 4  # the low budget closed it
    with client.responses.stream(model="default", input="Why is the sky blue?", reasoning={"effort": "low"},
                                 temperature=0, max_output_tokens=40) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == reasoning.content[0].text
    # the answer after the reasoning is what text.format constrains
    for seed in range(3):
        structured = client.responses.create(
            model="default", input="Describe a person.", reasoning={"effort": "low"}, temperature=1.0,
            max_output_tokens=120, extra_body={"seed": seed},
            text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
        assert [item.type for item in structured.output] in (["reasoning", "message"], ["message"])
        jsonschema.validate(json.loads(structured.output_text), PERSON)
