"""The Jinja-template path: SmolLM2's real GGUF tokenizer and template, and a Hermes/Qwen-style template."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from localmoe.chat import ChatMessage, JinjaFormat, ParsedReply, ToolCall, chat_format_for
from localmoe.tokenizer import Tokenizer


def hermes_template(opens_thinking: bool = False) -> str:
    """A cut-down Qwen-style template: tools in the system prompt, <think> reasoning, Hermes tool calls."""
    return "".join([
        "{%- if tools -%}{{ '<|im_start|>system\\n# Tools\\n<tools>\\n' }}",
        "{%- for t in tools -%}{{ t | tojson }}{{ '\\n' }}{%- endfor -%}{{ '</tools><|im_end|>\\n' }}{%- endif -%}",
        "{%- for m in messages -%}",
        "{%- if m.role == 'assistant' -%}{{ '<|im_start|>assistant\\n' }}",
        "{%- if m.reasoning_content -%}{{ '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}{%- endif -%}",
        "{{ m.content }}",
        "{%- for c in m.tool_calls or [] -%}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name",
        " + '\", \"arguments\": ' + (c.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor -%}",
        "{{ '<|im_end|>\\n' }}",
        "{%- elif m.role == 'tool' -%}",
        "{{ '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}",
        "{%- else -%}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif -%}",
        "{%- endfor -%}",
        "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}",
        "{{ '<think>\\n' }}" if opens_thinking else "",
        "{%- endif -%}",
    ])


def with_template(tokenizer, template):
    return Tokenizer(tokenizer.backend, source="SmolLM2 + test template", bos_token_id=tokenizer.bos_token_id,
                     eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                     unk_token_id=tokenizer.unk_token_id, chat_template=template)


@pytest.fixture(scope="module")
def smol(smollm2_tokenizer):
    return JinjaFormat(smollm2_tokenizer)


@pytest.fixture(scope="module")
def hermes(smollm2_tokenizer):
    return JinjaFormat(with_template(smollm2_tokenizer, hermes_template()))


@pytest.fixture(scope="module")
def opened(smollm2_tokenizer):
    return JinjaFormat(with_template(smollm2_tokenizer, hermes_template(opens_thinking=True)))


def reply_ids(fmt, text):
    """What a model writing `text` and then its end-of-turn token produces."""
    return fmt.tokenizer.encode(text, add_special_tokens=False) + [fmt.tokenizer.token_to_id("<|im_end|>")]


def test_smollm2_render(smol, smollm2_tokenizer):
    assert chat_format_for("llama", smollm2_tokenizer).name == "jinja"
    assert not smol.thinks and smol.end_of_thinking_ids() == []
    ids = smol.render([ChatMessage("user", "Hi")])
    # SmolLM2-Instruct's template adds its default system prompt when there is none.
    text = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert smollm2_tokenizer.decode(ids) == text
    assert ids[0] == smollm2_tokenizer.token_to_id("<|im_start|>")
    assert smollm2_tokenizer.token_to_id("<|im_end|>") in smol.stop_token_ids()
    history = [ChatMessage("system", "Be terse."), ChatMessage("user", "2+2?"), ChatMessage("assistant", "4")]
    ids = smol.render(history, add_generation_prompt=False)
    assert smollm2_tokenizer.decode(ids) == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n" \
                                            "<|im_start|>assistant\n4<|im_end|>\n"


def test_smollm2_parse(smol, stream):
    ids = reply_ids(smol, "Hello there! 🙂 <think>not reasoning here</think>")
    expected = ParsedReply(content="Hello there! 🙂 <think>not reasoning here</think>")
    assert smol.parse(ids) == expected
    assert smol.parse(ids + reply_ids(smol, "ignored after the stop")) == expected
    assert stream(smol, ids)[1] == expected
    call = reply_ids(smol, 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Köln"}}\n</tool_call>')
    assert smol.parse(call) == ParsedReply(content="Sure.", tool_calls=[ToolCall("get_weather", {"city": "Köln"})])


HISTORY = [
    ChatMessage("system", "You help."),
    ChatMessage("user", "Weather in Paris and Rome?"),
    ChatMessage("assistant", "Checking both.", reasoning="Two cities, two calls.",
                tool_calls=[ToolCall("get_weather", {"city": "Paris"}), ToolCall("get_weather", {"city": "Rome",
                                                                                                  "days": [1, 2]})]),
    ChatMessage("tool", "sunny", name="get_weather", tool_call_id="a"),
    ChatMessage("tool", "rain", name="get_weather", tool_call_id="b"),
    ChatMessage("assistant", "Sunny in Paris, rain in Rome.", reasoning="Report it."),
    ChatMessage("assistant", 'Quotes " and <b>tags</b>\n\nand 日本語', reasoning=""),
]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def test_hermes_render_by_hand(hermes):
    assert hermes.thinks and not hermes.opens_thinking
    text = hermes.tokenizer.decode(hermes.render(HISTORY[1:4], tools=TOOLS))
    assert text == (
        '<|im_start|>system\n# Tools\n<tools>\n{"type": "function", "function": {"name": "get_weather", '
        '"parameters": {"type": "object"}}}\n</tools><|im_end|>\n'
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo cities, two calls.\n</think>\n\nChecking both.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_a_template_without_tools_gets_them_in_the_hermes_convention(smol, hermes, stream):
    """SmolLM2's template drops tools, calls and results: the conversation is rewritten first, so the
    model sees them, and what it rendered of an assistant turn parses back to that turn."""
    assert hermes.native_tools and not smol.native_tools
    tok = smol.tokenizer
    text = tok.decode(smol.render(HISTORY[1:5], tools=TOOLS))
    assert text.startswith("<|im_start|>system\nYou can call functions")  # declarations make a system message
    assert '<tools>\n{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}' \
           '\n</tools>' in text
    assert ('<|im_start|>assistant\nChecking both.\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call>\n<tool_call>') in text
    assert text.endswith("<|im_start|>user\nThe get_weather tool returned: sunny\nThe get_weather tool returned: "
                         "rain\nUsing these results, answer my question in a sentence.<|im_end|>\n"
                         "<|im_start|>assistant\n")  # one user turn per run of results, each naming its tool
    with_system = tok.decode(smol.render(HISTORY[:2], tools=TOOLS))
    assert with_system.startswith("<|im_start|>system\nYou help.\n\nYou can call functions")
    for i, m in enumerate(HISTORY):
        if m.role != "assistant":
            continue
        prompt = tok.decode(smol.render(HISTORY[:i], tools=TOOLS))
        full = tok.decode(smol.render(HISTORY[:i + 1], tools=TOOLS, add_generation_prompt=False))
        assert full.startswith(prompt)
        ids = tok.encode(full[len(prompt):], add_special_tokens=False)
        expected = ParsedReply(content=m.content, tool_calls=m.tool_calls)  # SmolLM2 shows no reasoning
        assert smol.parse(ids) == expected, i
        assert stream(smol, ids)[1] == expected


def test_template_output_parses_back(hermes, stream):
    """Each assistant message the template renders into history parses back to itself."""
    tok = hermes.tokenizer
    for i, m in enumerate(HISTORY):
        if m.role != "assistant":
            continue
        prompt = tok.decode(hermes.render(HISTORY[:i], tools=TOOLS))
        full = tok.decode(hermes.render(HISTORY[:i + 1], tools=TOOLS, add_generation_prompt=False))
        assert full.startswith(prompt)
        ids = tok.encode(full[len(prompt):], add_special_tokens=False)
        expected = ParsedReply(content=m.content, reasoning=m.reasoning or "", tool_calls=m.tool_calls)
        assert hermes.parse(ids) == expected, i
        assert stream(hermes, ids)[1] == expected


def test_generation_prompt_thatopens_thinking(opened, stream):
    assert opened.opens_thinking
    assert opened.tokenizer.decode(opened.render([ChatMessage("user", "x")])).endswith("<|im_start|>assistant\n<think>\n")
    ids = reply_ids(opened, "step one,\nstep two\n</think>\n\nThe answer.")
    expected = ParsedReply(content="The answer.", reasoning="step one,\nstep two")
    assert opened.parse(ids) == expected
    assert stream(opened, ids)[1] == expected
    assert opened.parse(reply_ids(opened, "cut off while thinking")) == ParsedReply(reasoning="cut off while thinking")
    budget = opened.tokenizer.encode("long", add_special_tokens=False) + opened.end_of_thinking_ids()
    assert opened.parse(budget + reply_ids(opened, "Done.")) == ParsedReply(content="Done.", reasoning="long")


@pytest.mark.parametrize("text,expected", [
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', ParsedReply(tool_calls=[ToolCall("f", {"a": 1})])),
    ('<tool_call>{"name": "f", "parameters": {"b": 2}, "id": "x"}</tool_call>',
     ParsedReply(tool_calls=[ToolCall("f", {"b": 2}, id="x")])),
    ('<tool_call>{"name": "f", "arguments": "oops"}</tool_call>',
     ParsedReply(tool_calls=[ToolCall("f", {}, raw_arguments="oops")])),
    ("<tool_call>not json</tool_call> after", ParsedReply(content="not json after")),
    ('A <tool_call>{"name": "g", "arguments": {}}</tool_call> B', ParsedReply(content="A  B",
                                                                            tool_calls=[ToolCall("g", {})])),
    ('<tool_call>{"name": "cut", "argu', ParsedReply(content='{"name": "cut", "argu')),
    ("  \n padded \n\n ", ParsedReply(content="padded")),
    ("<think>\n  r  \n</think>  c  ", ParsedReply(content="c", reasoning="r")),
    ("text ending in a partial marker <tool_c", ParsedReply(content="text ending in a partial marker <tool_c")),
], ids=["string_args", "parameters_and_id", "bad_args", "not_json", "between", "unclosed", "strip", "think",
        "partial_marker"])
def test_hermes_parse_cases(hermes, stream, text, expected):
    ids = reply_ids(hermes, text)
    assert hermes.parse(ids) == expected
    assert stream(hermes, ids)[1] == expected


PIECES = st.sampled_from(["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "f", "arguments": {}}',
                          '{"name": "g"}', " ", "\n", "a", "é", "🙂", "<", "</", "<tool", "think>", "_call>", "{"])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(parts=st.lists(PIECES, max_size=14), opens=st.booleans())
def test_stream_equals_parse_on_random_marker_soup(hermes, opened, stream, parts, opens):
    fmt = opened if opens else hermes
    ids = fmt.tokenizer.encode("".join(parts), add_special_tokens=False)
    assert stream(fmt, ids)[1] == fmt.parse(ids)



@pytest.mark.parametrize("text", ["1. Paris\n2. Lyon\n\n3. Nice", "a  b \n c\n \n", " \n lead\tthen  \n\n\n"],
                         ids=["list", "spaces", "leading"])
def test_whitespace_streams_when_it_arrives(hermes, stream, text):
    """A token of whitespace after text goes out at its own step, not with the next token (it was held until more text
    followed: a two-step gap before the next token, the stream's longest gaps). Leading whitespace is still dropped;
    the streamed text is the reply's plus its trailing whitespace."""
    ids = reply_ids(hermes, text)
    parser = hermes.stream_parser()
    started = False
    for i in ids[:-1]:
        piece, out = hermes.tokenizer.decode([i]), "".join(d.text for d in parser.feed(i))
        assert out == (piece if started else piece.lstrip())
        started = started or bool(out)
    assert sum(hermes.tokenizer.decode([i]).isspace() for i in ids) >= 2  # the case has whitespace tokens
    deltas, reply = stream(hermes, ids)
    assert "".join(d.text for d in deltas) == text.lstrip() and reply.content == text.strip()


def test_reasoning_streams_whitespace_too(opened, stream):
    deltas, reply = stream(opened, reply_ids(opened, "a\n\nb \n</think>\n\n c \n"))
    assert "".join(d.text for d in deltas if d.channel == "reasoning") == "a\n\nb \n"
    assert "".join(d.text for d in deltas if d.channel == "content") == "c \n"
    assert reply == ParsedReply(content="c", reasoning="a\n\nb")


def test_a_partial_marker_is_still_held(hermes):
    ids = hermes.tokenizer.encode("ok <", add_special_tokens=False)
    parser = hermes.stream_parser()
    out = "".join(d.text for i in ids for d in parser.feed(i))
    assert out == "ok "  # "<" could start <tool_call>: held until the next token shows it does not
    assert "".join(d.text for d in parser.feed(hermes.tokenizer.encode("b", add_special_tokens=False)[0])) == "<b"
