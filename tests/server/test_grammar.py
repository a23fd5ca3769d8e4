"""The grammar engine (chat/grammar.py): JSON Schema and forced-call grammars accept exactly
the valid texts, and constrained sampling ends in a valid value whatever the logits."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.chat import grammar
from localmoe.chat.grammar import Constraint, GrammarError, GrammarTokenizer

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"}, "scale": {"type": "number"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
    "required": ["city", "unit"], "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from localmoe.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(tiny_model)


@pytest.fixture(scope="module")
def engine(tokenizer):
    return GrammarTokenizer(tokenizer)


def state_after(engine, tokenizer, text: str, g: str) -> Constraint | None:
    """The constraint after `text` (tokenised as the model would), or None when a token is refused."""
    c = Constraint(engine, g)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not c.matcher.consume_token(token):
            return None
    return c


def whole(engine, tokenizer, text: str, g: str | None = None) -> bool:
    c = state_after(engine, tokenizer, text, g or grammar.json_schema_grammar(SCHEMA))
    return c is not None and c.done


@pytest.mark.parametrize("text", [
    '{"city": "Paris", "unit": "celsius"}',
    '{"city": "Rome", "unit": "fahrenheit", "days": 3}',
    '{"city": "a\\"b\\u0001é", "unit": "celsius", "scale": -1.5e3, "ok": true, "tags": ["x", "y"]}',
    '{"city": "", "unit": "celsius", "tags": [], "where": {"lat": 0.25}}',
])
def test_valid_objects_are_accepted(engine, tokenizer, text):
    assert whole(engine, tokenizer, text) and json.loads(text)


@pytest.mark.parametrize("text, why", [
    ('{"city": "Paris"}', "a required key is missing"),
    ('{"city": "Paris", "unit": "kelvin"}', "not in the enum"),
    ('{"city": 3, "unit": "celsius"}', "wrong type"),
    ('{"city": "P", "unit": "celsius", "days": 1.5}', "integer with a fraction"),
    ('{"city": "P", "unit": "celsius", "other": 1}', "undeclared key"),
    ('{"city": "P", "unit": "celsius",}', "trailing comma"),
    ('{"city": "P", "unit": "celsius", "tags": ["a", "b", "c", "d"]}', "over maxItems"),
    ('{"city": "P", "unit": "celsius"} ', "text after the object"),
    ('["city"]', "not an object"),
    ('{"city": "P", "unit": "celsius", "days": 01}', "leading zero"),
    ('{"city": "a\nb", "unit": "celsius"}', "raw control character"),
    ('{"city":"P", "unit": "celsius"}', "whitespace other than the fixed separators"),
    ('{"unit": "celsius", "city": "P"}', "keys out of the schema's order"),
])
def test_invalid_objects_are_rejected(engine, tokenizer, text, why):
    assert not whole(engine, tokenizer, text), why


def test_prefixes_are_accepted_and_completion_is_exact(engine, tokenizer):
    text = '{"city": "Paris", "unit": "celsius", "days": 10}'
    g = grammar.json_schema_grammar(SCHEMA)
    for n in (1, 5, 12, 20, len(text) - 1):
        c = state_after(engine, tokenizer, text[:n], g)
        assert c is not None and not c.done, text[:n]
    assert whole(engine, tokenizer, text)


def test_tool_arguments_are_closed_and_capped():
    capped = grammar.bounded({"type": "object", "properties": {"q": {"type": "string"},
                                                               "ids": {"type": "array", "items": {"type": "string"}}}})
    assert capped["additionalProperties"] is False
    assert capped["properties"]["q"]["maxLength"] == grammar.MAX_STRING
    assert capped["properties"]["ids"]["maxItems"] == grammar.MAX_ITEMS
    assert capped["properties"]["ids"]["items"]["maxLength"] == grammar.MAX_STRING
    kept = grammar.bounded({"type": "object", "properties": {"type": {"type": "string", "enum": ["a", "b"]}},
                            "additionalProperties": True})
    assert kept["additionalProperties"] is True and "maxLength" not in kept["properties"]["type"]


def test_literal_prefix_and_name_choice_bind_the_schema(engine, tokenizer):
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
               "get_time": {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}}
    g = grammar.tool_call_grammar(['{"name": "', ("get_weather", "get_time"), '", "arguments": '], schemas)
    assert whole(engine, tokenizer, '{"name": "get_time", "arguments": {"tz": 9}', g)
    assert state_after(engine, tokenizer, '{"name": "get_time", "arguments": {"city": "x"', g) is None
    assert whole(engine, tokenizer, '{"name": "get_weather", "arguments": {"city": "x"}', g)
    assert state_after(engine, tokenizer, '{"name": "get_wrong"', g) is None


def test_schemas_the_engine_cannot_compile_name_the_field(engine):
    with pytest.raises(GrammarError, match="response_format"):
        grammar.json_schema_grammar(["not", "a", "schema"], "response_format")
    with pytest.raises(GrammarError, match="Invalid type"):
        Constraint(engine, grammar.json_schema_grammar({"type": "strin"}))


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.5]))
def test_constrained_sampling_always_yields_a_valid_object(engine, tokenizer, seed, temperature):
    """Whatever the logits, sampling from the masked logits ends in a whole object matching the schema."""
    from localmoe.engine.sampler import SamplingParams, sample

    schema = grammar.bounded({"type": "object", "properties": {k: SCHEMA["properties"][k] for k in
                                                               ("city", "unit", "days", "ok")},
                              "required": ["city", "unit"]})
    c = Constraint(engine, grammar.json_schema_grammar(schema))
    params = SamplingParams(temperature=temperature, seed=seed)
    generator = params.make_generator()
    ids = []
    for _ in range(300):
        logits = torch.randn(1, tokenizer.vocab_size + 5, generator=generator) * 4  # padded like a model's head
        token = int(sample(c.mask(logits), params, generator))
        assert token < tokenizer.vocab_size and token != engine.eos
        c.consume(token)
        ids.append(token)
        if c.done:
            break
    assert c.done, tokenizer.decode(ids)
    value = json.loads(tokenizer.decode(ids))
    assert {"city", "unit"} <= set(value) <= {"city", "unit", "days", "ok"}
    assert value["unit"] in ("celsius", "fahrenheit") and isinstance(value["city"], str)


def test_mask_handles_heads_wider_and_narrower_than_the_tokenizer(engine, tokenizer):
    allowed = Constraint(engine, grammar.json_object_grammar()).mask(torch.zeros(1, tokenizer.vocab_size))
    allowed = set(torch.isfinite(allowed[0]).nonzero().flatten().tolist())
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    wide = Constraint(engine, grammar.json_object_grammar()).mask(torch.zeros(1, tokenizer.vocab_size + 7))
    assert wide.shape[1] == tokenizer.vocab_size + 7 and set(torch.isfinite(wide[0]).nonzero().flatten().tolist()) \
        == allowed
    narrow = Constraint(engine, grammar.json_object_grammar()).mask(torch.zeros(1, tokenizer.vocab_size - 100))
    assert narrow.shape[1] == tokenizer.vocab_size - 100
    assert set(torch.isfinite(narrow[0]).nonzero().flatten().tolist()) == {t for t in allowed
                                                                            if t < tokenizer.vocab_size - 100}
