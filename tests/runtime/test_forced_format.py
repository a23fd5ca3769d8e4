"""A forced tool call is written in the model's own format, also for a template without tools."""

from __future__ import annotations

import json

from localmoe.chat import ChatMessage, JinjaFormat
from localmoe.runtime.forced import plan_forced_call
from localmoe.tokenizer import tokenizer_from_gguf

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}


def test_forced_call_on_smollm2_opens_a_hermes_tool_call(smollm2_gguf):
    tokenizer = tokenizer_from_gguf(smollm2_gguf)
    fmt = JinjaFormat(tokenizer)
    assert not fmt.native_tools  # SmolLM2's own template drops tools: the Hermes rewrite applies
    messages = [ChatMessage("user", "Weather in Paris?")]
    tools = [WEATHER, TIME]
    prompt = fmt.render(messages, tools=tools)
    plan = plan_forced_call(fmt, tokenizer, messages, tools, ["get_weather", "get_time"], prompt, None)
    # the constrained text is the call's opening as the conversation renders it, then the name slot
    literal = tokenizer.decode(plan.inject) + "".join(s for s in plan.segments if isinstance(s, str))
    assert literal.startswith("<tool_call>") and '"name": "' in literal
    assert ("get_weather", "get_time") in plan.segments
    # what the constraint allows parses back, with the format's own parser, as that call
    constrained = "".join(s if isinstance(s, str) else "get_weather" for s in plan.segments) + \
        json.dumps({"city": "Paris"})
    assert plan.split(constrained) == ("get_weather", json.dumps({"city": "Paris"}))
    text = tokenizer.decode(plan.inject) + constrained + "}\n</tool_call>"
    reply = fmt.parse(tokenizer.encode(text, add_special_tokens=False))
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_forced_call_of_one_tool_on_harmony_injects_the_whole_opening(tmp_path):
    """Harmony puts special tokens between the name and the arguments (<|constrain|>json<|message|>):
    with one allowed name the opening is injected as ids and only the JSON arguments are constrained."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    loaded = load_model(write_checkpoint("gpt_oss", tmp_path, "tiny", seed=0), EngineConfig(), progress=False)
    fmt, tokenizer = loaded.chat_format, loaded.tokenizer
    messages = [ChatMessage("user", "Weather in Paris?")]
    prompt = fmt.render(messages, tools=[WEATHER, TIME])
    plan = plan_forced_call(fmt, tokenizer, messages, [WEATHER, TIME], ["get_weather"], prompt, None)
    assert plan.segments == [] and plan.names == ["get_weather"]
    opening = tokenizer.decode(plan.inject)
    assert opening.startswith("<|channel|>commentary to=functions.get_weather") and opening.endswith("<|message|>")
    ids = plan.inject + tokenizer.encode(json.dumps({"city": "Paris"}), add_special_tokens=False) \
        + [tokenizer.token_to_id("<|call|>")]
    reply = fmt.parse(ids)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]


def test_forced_call_on_xtml_writes_the_arguments_as_one_json_element(tmp_path):
    """XTML writes an object's arguments key by key, typed; a forced call injects the call's opening up to
    XTML's whole-object element (`<|open|>arguments type="json"<|sep|>`) and constrains that JSON."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    loaded = load_model(write_checkpoint("kimi_k3", tmp_path, "tiny", seed=0), EngineConfig(), progress=False)
    fmt, tokenizer = loaded.chat_format, loaded.tokenizer
    messages = [ChatMessage("user", "Weather in Paris?")]
    prompt = fmt.render(messages, tools=[WEATHER, TIME])
    plan = plan_forced_call(fmt, tokenizer, messages, [WEATHER, TIME], ["get_weather"], prompt, None)
    assert plan.segments == []
    opening = tokenizer.decode(plan.inject)
    assert '<|open|>call tool="get_weather" index="1"<|sep|>' in opening
    assert opening.endswith('<|open|>arguments type="json"<|sep|>')
    close, sep = tokenizer.token_to_id("<|close|>"), tokenizer.token_to_id("<|sep|>")

    def closing(tag: str) -> list[int]:
        return [close, *tokenizer.encode(tag, add_special_tokens=False), sep]

    ids = (plan.inject + tokenizer.encode(json.dumps({"city": "Paris"}), add_special_tokens=False)
           + closing("arguments") + closing("call") + closing("tools"))
    reply = fmt.parse(ids)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == [("get_weather", {"city": "Paris"})]
