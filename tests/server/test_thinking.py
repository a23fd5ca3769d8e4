"""Thinking budgets on thinking families: gpt-oss (harmony) now, Kimi K3 (XTML) once it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

from tests.server.conftest import start_server

LOW = 8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gpt_oss_server(tmp_path_factory):
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt-oss"), size="tiny")
    server = start_server(
        path,
        tmp_path_factory.mktemp("gpt-oss-logs"),
        "--max-context",
        "512",
        "--no-sessions",
        "--thinking-budgets",
        f"low={LOW},high={4 * LOW},max=none",
    )
    yield server
    server.stop()


def _ask(server, effort, **extra):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    return client.chat.completions.create(
        extra_body=extra,
        model="default",
        temperature=0,
        max_tokens=40,
        reasoning_effort=effort,
        messages=[{"role": "user", "content": "Think, then answer: 2+2?"}],
    )


def test_low_effort_stops_reasoning_at_the_limit_and_answers(gpt_oss_server):
    unlimited = _ask(gpt_oss_server, "low", max_reasoning_tokens=10_000)  # same prompt, no effective limit
    low = _ask(gpt_oss_server, "low")
    # the random model never closes its reasoning by itself: without a limit it reasons to max_tokens
    assert unlimited.usage.completion_tokens_details.reasoning_tokens > LOW
    assert low.usage.completion_tokens_details.reasoning_tokens == LOW
    assert low.usage.completion_tokens > LOW  # generation went on past the end-of-thinking marker
    assert low.choices[0].finish_reason in ("stop", "length")
    assert low.choices[0].message.content != unlimited.choices[0].message.content


def test_anthropic_budget_tokens(gpt_oss_server):
    client = anthropic.Anthropic(base_url=gpt_oss_server.url, api_key="unused", max_retries=0, timeout=120)
    reply = client.messages.create(
        model="default",
        max_tokens=24,
        thinking={"type": "enabled", "budget_tokens": 5},
        messages=[{"role": "user", "content": "2+2?"}],
        extra_body={"temperature": 0},
    )
    assert reply.usage.output_tokens > 5
    assert reply.stop_reason in ("end_turn", "max_tokens")


def _k3_runnable() -> bool:
    from localmoe.models import family_for_model_type

    try:
        return family_for_model_type("kimi_k3").runnable
    except Exception:  # noqa: BLE001 - the family may not be registered yet
        return False


k3_runnable = _k3_runnable()

needs_k3 = pytest.mark.skipif(
    not k3_runnable,
    reason="kimi_k3 is not runnable in this version yet (family_for_model_type('kimi_k3').runnable is False)",
)


@pytest.fixture(scope="module")
def k3_server(tmp_path_factory):
    from localmoe.testing import write_checkpoint

    source = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3"), size="tiny")
    store = tmp_path_factory.mktemp("k3-store") / "store"
    subprocess.run([sys.executable, "-m", "localmoe", "convert", str(source), str(store)], check=True)
    server = start_server(
        store,
        tmp_path_factory.mktemp("k3-logs"),
        "--max-context",
        "512",
        "--no-sessions",
        "--thinking-budgets",
        f"low={LOW},high={4 * LOW},max=none",
    )
    yield server
    server.stop()


@needs_k3
def test_k3_chat_stream_and_forced_tool_round_trip(k3_server):
    client = openai.OpenAI(base_url=k3_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "weather in Paris?"}]
    whole = client.chat.completions.create(model="default", temperature=0, max_tokens=12, messages=messages)
    streamed = client.chat.completions.create(
        model="default", temperature=0, max_tokens=12, messages=messages, stream=True
    )
    content = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert content == (whole.choices[0].message.content or "")
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    first = client.chat.completions.create(
        model="default", temperature=0, max_tokens=64, messages=messages, tools=[tool], tool_choice="required"
    )
    (call,) = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    final = client.chat.completions.create(
        model="default", temperature=0, max_tokens=12, messages=messages, tools=[tool], tool_choice="none"
    )
    assert final.choices[0].finish_reason in ("stop", "length")


@needs_k3
def test_k3_low_effort_stops_reasoning_at_the_limit(k3_server):
    unlimited = _ask(k3_server, "low", max_reasoning_tokens=10_000)  # the same prompt (K3 renders the tier)
    low = _ask(k3_server, "low")
    if unlimited.usage.completion_tokens_details.reasoning_tokens > LOW:
        assert low.usage.completion_tokens_details.reasoning_tokens == LOW
        assert low.usage.completion_tokens > LOW  # it went on to answer after the closed think channel
    else:  # the model closed its reasoning by itself before the limit: the budget changes nothing
        assert (
            low.usage.completion_tokens_details.reasoning_tokens
            == unlimited.usage.completion_tokens_details.reasoning_tokens
        )
    assert low.choices[0].finish_reason in ("stop", "length")


def test_wall_clock_budget_ends_a_long_generation(gpt_oss_server):
    """max_time_s closes the reasoning, and at twice that the generation stops (finish_reason length)."""
    client = openai.OpenAI(base_url=gpt_oss_server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    free = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=200,
        reasoning_effort="max",
        messages=[{"role": "user", "content": "go"}],
    )
    timed = client.chat.completions.create(
        model="default",
        temperature=0,
        max_tokens=200,
        reasoning_effort="max",
        messages=[{"role": "user", "content": "go"}],
        extra_body={"max_time_s": 0.002},  # 200 tokens of this model take well under 0.1 s now
    )
    assert free.usage.completion_tokens > 50  # the random model goes on for long by itself
    assert timed.choices[0].finish_reason == "length"
    assert timed.usage.completion_tokens < free.usage.completion_tokens


def test_anthropic_output_config_effort_low_caps_reasoning_like_reasoning_effort_low(gpt_oss_server):
    """The anthropic SDK 2.x sends output_config.effort: low maps to the same tier as reasoning_effort=low."""
    client = anthropic.Anthropic(base_url=gpt_oss_server.url, api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Think, then answer: 2+2?"}]
    reply = client.messages.create(model="default", max_tokens=40, messages=messages,
                                   output_config={"effort": "low"}, extra_body={"temperature": 0})
    thinking = "".join(b.thinking for b in reply.content if b.type == "thinking")
    text = "".join(b.text for b in reply.content if b.type == "text")
    low = _ask(gpt_oss_server, "low")
    assert low.usage.completion_tokens_details.reasoning_tokens == LOW  # the cap reasoning_effort=low sets
    assert reply.usage.output_tokens == low.usage.completion_tokens
    assert (thinking, text) == (low.choices[0].message.model_dump().get("reasoning_content", ""),
                                low.choices[0].message.content or "")
