"""The JSON constraint for forced tool-call arguments: prefixes, completion, and token choice."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from localmoe.chat import constrain
from localmoe.chat.constrain import TokenTexts, advance, choose_token, initial_state, is_complete

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "days": {"type": "integer"}, "scale": {"type": "number"}, "ok": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3},
    "where": {"type": "object", "properties": {"lat": {"type": "number"}}, "required": ["lat"]}},
    "required": ["city", "unit"]}


def whole(text: str, schema=SCHEMA, prefix="") -> bool:
    state = advance(initial_state(schema, prefix), text)
    return state is not None and is_complete(state)


def prefix_ok(text: str, schema=SCHEMA) -> bool:
    return advance(initial_state(schema), text) is not None


@pytest.mark.parametrize("text", [
    '{"city": "Paris", "unit": "celsius"}',
    '{"unit":"fahrenheit","city":"Rome","days":3}',
    '{"city": "a\\"b\\u00e9", "unit": "celsius", "scale": -1.5e3, "ok": true, "tags": ["x", "y"]}',
    '{"city": "", "unit": "celsius", "where": {"lat": 0.25}, "tags": []}',
])
def test_valid_objects_are_accepted(text):
    assert whole(text) and json.loads(text)


@pytest.mark.parametrize("text, why", [
    ('{"city": "Paris"}', "a required key is missing"),
    ('{"city": "Paris", "unit": "kelvin"}', "not in the enum"),
    ('{"city": 3, "unit": "celsius"}', "wrong type"),
    ('{"city": "P", "unit": "celsius", "days": 1.5}', "integer with a fraction"),
    ('{"city": "P", "unit": "celsius", "other": 1}', "undeclared key"),
    ('{"city": "P", "city": "Q", "unit": "celsius"}', "duplicate key"),
    ('{"city": "P", "unit": "celsius",}', "trailing comma"),
    ('{"city": "P", "unit": "celsius", "tags": ["a", "b", "c", "d"]}', "over maxItems"),
    ('{"city": "P", "unit": "celsius"} ', "text after the object"),
    ('["city"]', "not an object"),
    ('{"city": "P", "unit": "celsius", "days": 01}', "leading zero"),
    ('{"city": "a\nb", "unit": "celsius"}', "raw control character"),
])
def test_invalid_objects_are_rejected(text, why):
    assert not whole(text), why


def test_prefixes_of_valid_objects_are_accepted_and_completion_is_exact():
    text = '{"city": "Paris", "unit": "celsius", "days": 10}'
    for n in range(len(text)):
        assert prefix_ok(text[:n]), text[:n]
        assert n == 0 or not is_complete(advance(initial_state(SCHEMA), text[:n]))
    assert whole(text)


def test_strings_and_whitespace_are_capped():
    long = '{"city": "' + "a" * (constrain.MAX_STRING + 1)
    assert not prefix_ok(long)
    assert not prefix_ok("{" + " " * (constrain.MAX_WS_RUN + 1))


def test_literal_prefix_and_name_choice_bind_the_schema():
    schemas = {"get_weather": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
               "get_time": {"type": "object", "properties": {"tz": {"type": "integer"}}, "required": ["tz"]}}
    segments = ['{"name": "', ("get_weather", "get_time"), '", "arguments": ']
    state = initial_state({}, segments, schemas=schemas)
    assert advance(state, '{"name": "get_time", "arguments": {"tz": 9}') is not None
    assert advance(state, '{"name": "get_time", "arguments": {"city": "x"') is None
    assert advance(state, '{"name": "get_weather", "arguments": {"city": "x"}') is not None
    assert advance(state, '{"name": "get_wrong"') is None


class _Vocab:
    """A toy vocabulary: every printable ASCII character, a few multi-character pieces, one special token."""

    def __init__(self):
        pieces = [chr(c) for c in range(32, 127)] + ['{"', '":', ' "', '",', '"}', "city", "unit", "celsius", "}}",
                                                     "<|end|>"]
        self.texts = TokenTexts([None if p == "<|end|>" else p for p in pieces])
        self.pieces = pieces


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), temperature=st.sampled_from([0.0, 0.7, 1.5]))
def test_choose_token_always_yields_a_valid_object(seed, temperature):
    """Whatever the logits, constrained generation ends in a whole object matching the schema."""
    vocab = _Vocab()
    generator = torch.Generator().manual_seed(seed)
    schema = {k: v for k, v in SCHEMA.items() if k != "properties"}
    schema["properties"] = {k: SCHEMA["properties"][k] for k in ("city", "unit", "days", "ok")}
    state, text = initial_state(schema), ""
    for _ in range(400):
        logits = torch.randn(len(vocab.pieces), generator=generator) * 4
        choice = choose_token(logits, state, vocab.texts, temperature, generator)
        assert choice is not None
        token, state = choice
        assert vocab.pieces[token] != "<|end|>"
        text += vocab.pieces[token]
        if is_complete(state):
            break
    assert is_complete(state), text
    value = json.loads(text)
    assert {"city", "unit"} <= set(value) <= {"city", "unit", "days", "ok"}
    assert value["unit"] in ("celsius", "fahrenheit") and isinstance(value["city"], str)


def test_choose_token_prefers_the_best_valid_token():
    vocab = _Vocab()
    logits = torch.zeros(len(vocab.pieces))
    logits[vocab.pieces.index("x")] = 10  # best but invalid as the first character
    logits[vocab.pieces.index('{"')] = 5
    logits[vocab.pieces.index("{")] = 4
    token, _ = choose_token(logits, initial_state(SCHEMA), vocab.texts)
    assert vocab.pieces[token] == '{"'


def test_token_texts_of_a_real_tokenizer(tiny_model):
    from localmoe.tokenizer import tokenizer_from_hf_dir

    tokenizer = tokenizer_from_hf_dir(tiny_model)
    texts = TokenTexts.for_tokenizer(tokenizer)
    assert len(texts.texts) == tokenizer.vocab_size
    for token_id, text in enumerate(texts.texts):
        if text is not None and token_id % 7 == 0:
            assert (tokenizer.decode(tokenizer.encode("a", add_special_tokens=False)[-1:] + [token_id])
                    .endswith(text))
    special = [i for i in tokenizer.backend.get_added_tokens_decoder()]
    assert special and all(texts.texts[i] is None for i in special)
