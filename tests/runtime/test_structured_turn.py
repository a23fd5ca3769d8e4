"""Constrained turns on every test family (tiny random checkpoints, so validity comes from the
grammar): the answer under an output schema after the reasoning (thinking formats: harmony,
XTML, Jinja <think>), and forced tool calls, sampled at temperature 1."""

from __future__ import annotations

import json

import pytest

from localmoe.chat import ChatMessage
from localmoe.chat.budget import Budget
from localmoe.chat.grammar import Constraint, GrammarTokenizer, json_schema_grammar
from localmoe.engine.sampler import SamplingParams
from localmoe.runtime.forced import plan_forced_call
from localmoe.runtime.turn import Prepared, run_chat
from localmoe.runtime.worker import EngineWorker, Job
from localmoe.testing import FAMILIES

jsonschema = pytest.importorskip("jsonschema")

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"type": "string", "enum": ["a", "b"]}},
          "required": ["ok", "n", "tag"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "integer", "minimum": -12, "maximum": 14}}, "required": ["tz"]}}}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def loaded(request, tmp_path_factory):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny", seed=0)
    return load_model(path, EngineConfig(), progress=False)


def run(loaded, prep: Prepared):
    events, worker = [], EngineWorker(batching="on")
    worker.submit(Job(lambda job: run_chat(loaded.chat_format, loaded.tokenizer, loaded.model, prep, job.emit,
                                           lambda: job.cancelled), lambda k, p: events.append((k, p))))
    while not any(k in ("done", "error") for k, _ in events):
        worker.step()
    (result,) = [p for k, p in events if k == "done"]
    return result, events


def test_the_answer_matches_the_schema_after_the_reasoning(loaded):
    fmt, tokenizer = loaded.chat_format, loaded.tokenizer
    engine = GrammarTokenizer(tokenizer, fmt.stop_token_ids())
    prompt = fmt.render([ChatMessage("user", "Status as JSON?")], reasoning_effort="low")
    for seed in range(2):
        prep = Prepared(prompt=prompt, max_tokens=80, params=SamplingParams(temperature=1.0, seed=seed),
                        budget=Budget(reasoning_tokens=4),
                        constraint=Constraint(engine, json_schema_grammar(SCHEMA)))
        result, events = run(loaded, prep)
        assert result.finish_reason == "stop", (result.content, result.reasoning)
        jsonschema.validate(json.loads(result.content), SCHEMA)
        streamed = "".join(p.text for k, p in events if k == "delta" and p.channel == "content")
        assert streamed == result.content


def test_forced_calls_parse_and_match_the_tool_schema(loaded):
    fmt, tokenizer = loaded.chat_format, loaded.tokenizer
    engine = GrammarTokenizer(tokenizer, fmt.stop_token_ids())
    messages = [ChatMessage("user", "Weather in Paris?")]
    prompt = fmt.render(messages, tools=[WEATHER, TIME])
    schemas = {"get_weather": WEATHER, "get_time": TIME}
    for names in (["get_weather"], ["get_weather", "get_time"]):
        plan = plan_forced_call(fmt, tokenizer, messages, [WEATHER, TIME], names, prompt, None)
        for seed in range(1):
            prep = Prepared(prompt=prompt, max_tokens=64, params=SamplingParams(temperature=1.0, seed=seed),
                            forced=plan, constraint=Constraint(engine, plan.grammar()))
            result, _ = run(loaded, prep)
            assert result.finish_reason == "tool_calls"
            (call,) = result.tool_calls
            assert call.name in names and call.raw_arguments is None
            jsonschema.validate(call.arguments, schemas[call.name]["function"]["parameters"])
