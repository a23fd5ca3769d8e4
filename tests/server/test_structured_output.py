"""Structured output through the grammar engine, with the official SDKs over a real server on
the embedded model (SmolLM2-135M-Instruct): a tiny model, so validity comes from the
constraint, not from the model."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "mood": {"type": "string", "enum": ["happy", "sad", "calm"]},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3}},
    "required": ["name", "age", "mood", "tags"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Describe a person as JSON: name, age, mood and tags."}]


@pytest.fixture(scope="module")
def client(real_server):
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_json_schema_output_validates_at_temperature_07_over_20_seeds(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    answers = set()
    for seed in range(20):
        reply = client.chat.completions.create(model="default", messages=PROMPT, temperature=0.7, seed=seed,
                                               max_tokens=200, response_format=fmt)
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        value = json.loads(choice.message.content)
        jsonschema.validate(value, PERSON)
        answers.add(choice.message.content)
    assert len(answers) > 1  # sampled, not one forced text


def test_strict_closes_objects_to_their_declared_keys(client):
    open_schema = {k: v for k, v in PERSON.items() if k != "additionalProperties"}
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": open_schema, "strict": True}}
    for seed in range(3):
        reply = client.chat.completions.create(model="default", messages=PROMPT, temperature=1.0, seed=seed,
                                               max_tokens=200, response_format=fmt)
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_json_object_mode_returns_an_object(client):
    reply = client.chat.completions.create(model="default", messages=PROMPT, temperature=0, max_tokens=200,
                                           response_format={"type": "json_object"})
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(reply.choices[0].message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert reply.choices[0].message.content.startswith("{")


def test_streamed_structured_output_equals_a_valid_document(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    stream = client.chat.completions.create(model="default", messages=PROMPT, temperature=0.7, seed=3,
                                            max_tokens=200, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), PERSON)


def test_parse_helper_returns_the_pydantic_object(client):
    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=24)
        population: int = Field(ge=0, le=10**8)

    reply = client.chat.completions.parse(model="default", messages=[{"role": "user", "content": "A city?"}],
                                          temperature=0.7, seed=1, max_tokens=120, response_format=City)
    city = reply.choices[0].message.parsed
    assert isinstance(city, City) and 0 <= city.population <= 10**8


@pytest.mark.parametrize("fmt, field", [
    ({"type": "json_schema"}, "json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}, "name"),
    ({"type": "xml"}, "type"),
])
def test_bad_formats_are_400_naming_the_field(client, fmt, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="default", messages=PROMPT, max_tokens=8, response_format=fmt)
    assert field in str(e.value)


def test_anthropic_output_config_format_validates(real_server):
    anthropic = pytest.importorskip("anthropic")
    client = anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0, timeout=300)
    open_schema = {k: v for k, v in PERSON.items() if k != "additionalProperties"}  # Anthropic closes objects
    for _ in range(5):
        reply = client.messages.create(model="default", max_tokens=200, messages=PROMPT,
                                       output_config={"format": {"type": "json_schema", "schema": open_schema}},
                                       extra_body={"temperature": 0.7})
        assert reply.stop_reason == "end_turn" and reply.content[0].type == "text"
        jsonschema.validate(json.loads(reply.content[0].text), PERSON)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="default", max_tokens=8, messages=PROMPT,
                               output_config={"format": {"type": "json_schema", "schema": {"type": "strin"}}})
    assert "output_config.format" in str(e.value)
