"""Chat templates rendered by us against transformers' `apply_chat_template(..., tokenize=False)`."""

from datetime import datetime

import pytest
import tokenizers

from localmoe.chat.template import render_chat_template
from localmoe.errors import TokenizerError
from localmoe.tokenizer import tokenizer_from_gguf

CONVERSATIONS = {
    "user_only": [{"role": "user", "content": "Hi!"}],
    "with_system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    "multi_turn": [
        {"role": "user", "content": "Translate 'cat' to German."},
        {"role": "assistant", "content": "Katze."},
        {"role": "user", "content": "Und auf Japanisch? 日本語で"},
    ],
    "system_multi_turn": [
        {"role": "system", "content": "Answer in JSON."},
        {"role": "user", "content": "Give me {\"a\": 1}\nwith newlines\n\n"},
        {"role": "assistant", "content": "{\"a\": 1}"},
        {"role": "user", "content": "  spaces  "},
    ],
}

# Exercises what templates use: tojson (non-ASCII, indent), tools, bos/eos, extra variables,
# loop controls, whitespace control, namespace, generation blocks.
FEATURE_TEMPLATE = """{{ bos_token }}
{% if tools %}Tools: {{ tools | tojson }}
Pretty: {{ tools[0] | tojson(indent=2) }}
{% endif %}
{% set ns = namespace(n=0) %}
{% for message in messages %}
    {% if message['role'] == 'stop' %}{% break %}{% endif %}
    {% set ns.n = ns.n + 1 %}
    <{{ message['role'] }}>{{ message['content'] | trim }}{% if not loop.last %}{{ eos_token }}{% endif %}

{% endfor %}
{% if add_generation_prompt %}<assistant>{% if enable_thinking %}<think>{% endif %}{% endif %}
count={{ ns.n }}"""

TOOLS = [{"type": "function", "function": {"name": "météo", "description": "Wetter für eine Stadt",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return tokenizer_from_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf(ours):
    """transformers' template rendering around the same tokenizer (no second GGUF load needed)."""
    transformers = pytest.importorskip("transformers")
    backend = tokenizers.Tokenizer.from_str(ours.backend.to_str())  # a copy: transformers may modify it
    return transformers.PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=ours.chat_template,
                                                **ours.special_tokens)


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen_prompt", "no_gen_prompt"])
@pytest.mark.parametrize("name", CONVERSATIONS)
def test_smollm2_template_equals_transformers(ours, hf, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
    if name == "user_only":  # the template's default system prompt
        assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")


def test_rendered_template_tokens(ours, hf):
    text = ours.apply_chat_template(CONVERSATIONS["with_system"])
    ids = ours.encode(text)
    assert ids == hf.encode(text)
    assert ids[0] == ours.token_to_id("<|im_start|>") and ids.count(ours.token_to_id("<|im_end|>")) == 2


@pytest.mark.parametrize("add_generation_prompt", [True, False], ids=["gen_prompt", "no_gen_prompt"])
@pytest.mark.parametrize("with_tools", [True, False], ids=["tools", "no_tools"])
def test_feature_template_equals_transformers(ours, hf, with_tools, add_generation_prompt):
    messages = CONVERSATIONS["multi_turn"] + [{"role": "stop", "content": "never shown"}]
    tools = TOOLS if with_tools else None
    expected = hf.apply_chat_template(messages, chat_template=FEATURE_TEMPLATE, tools=tools, tokenize=False,
                                      add_generation_prompt=add_generation_prompt, enable_thinking=True)
    got = render_chat_template(FEATURE_TEMPLATE, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                               special_tokens=ours.special_tokens, enable_thinking=True)
    assert got == expected
    assert "never shown" not in got and "count=3" in got
    if with_tools:
        assert '"météo"' in got and '\n  "type": "function"' in got


def test_generation_block_and_strftime():
    template = "{% generation %}[{{ messages[0].content }}]{% endgeneration %} {{ strftime_now('%Y') }}"
    out = render_chat_template(template, [{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert out == f"[x] {datetime.now().year}"


def test_missing_template(ours):
    from localmoe.tokenizer import Tokenizer

    bare = Tokenizer(ours.backend, source="bare.gguf")
    with pytest.raises(TokenizerError, match="bare.gguf has no chat template"):
        bare.apply_chat_template(CONVERSATIONS["user_only"])


@pytest.mark.parametrize("template, message", [
    ("{% for m in messages %}{{ m.content }", "does not parse"),
    ("{% if x %}unclosed", "does not parse"),
    ("{{ raise_exception('Conversation roles must alternate') }}", "refused these messages: Conversation roles"),
    ("{{ messages[0].content + 1 }}", "failed while rendering: TypeError"),
    ("{{ ''.__class__.__mro__ }}", "failed while rendering: SecurityError"),
    ("{% set messages = [] %}{{ messages.append(1) }}", "failed while rendering: SecurityError"),
], ids=["syntax", "unclosed", "raise_exception", "type_error", "sandbox_attr", "sandbox_mutation"])
def test_broken_template_raises_tokenizer_error(template, message):
    with pytest.raises(TokenizerError, match=message) as info:
        render_chat_template(template, CONVERSATIONS["user_only"], add_generation_prompt=True, source="model.gguf")
    assert "model.gguf" in str(info.value)
