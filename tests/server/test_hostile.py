"""Malformed and hostile requests: each gets a 4xx JSON error and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import start_server

CHAT, COMPLETIONS, MESSAGES = "/v1/chat/completions", "/v1/completions", "/v1/messages"
USER = [{"role": "user", "content": "hi"}]


def chat(**fields):
    return {"model": "default", "messages": USER, "max_tokens": 4, **fields}


def weather(parameters):
    return [{"type": "function", "function": {"name": "get_weather", "parameters": parameters}}]


def deep(n: int) -> str:
    return '{"model": "default", "messages": ' + "[" * n + "]" * n + "}"


# (id, method, path, body: dict | str | bytes | None, headers, expected status)
CASES = [
    ("bad-json", "POST", CHAT, "{bad", {}, 400),
    ("empty-body", "POST", CHAT, "", {}, 400),
    ("array-body", "POST", CHAT, "[1, 2]", {}, 400),
    ("form-body", "POST", CHAT, "model=default", {"content-type": "application/x-www-form-urlencoded"}, 400),
    ("no-messages", "POST", CHAT, {"model": "default"}, {}, 400),
    ("empty-messages", "POST", CHAT, chat(messages=[]), {}, 400),
    ("messages-string", "POST", CHAT, chat(messages="hello"), {}, 400),
    ("bad-role", "POST", CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), {}, 400),
    ("content-int", "POST", CHAT, chat(messages=[{"role": "user", "content": 42}]), {}, 400),
    (
        "image-part",
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        {},
        400,
    ),
    ("max-tokens-string", "POST", CHAT, chat(max_tokens="lots"), {}, 400),
    ("max-tokens-negative", "POST", CHAT, chat(max_tokens=-5), {}, 400),
    ("max-tokens-huge", "POST", CHAT, chat(max_tokens=10**9), {}, 400),
    ("temperature-negative", "POST", CHAT, chat(temperature=-1), {}, 400),
    ("temperature-string", "POST", CHAT, chat(temperature="hot"), {}, 400),
    ("top-p-zero", "POST", CHAT, chat(top_p=0), {}, 400),
    ("seed-negative", "POST", CHAT, chat(seed=-1), {}, 400),
    ("n-two", "POST", CHAT, chat(n=2), {}, 400),
    ("unknown-model", "POST", CHAT, chat(model="gpt-17"), {}, 404),
    ("tool-schema-not-object", "POST", CHAT, chat(tools=weather({"type": "string"})), {}, 400),
    ("tool-properties-list", "POST", CHAT, chat(tools=weather({"type": "object", "properties": [1]})), {}, 400),
    (
        "tool-bad-type",
        "POST",
        CHAT,
        chat(tools=weather({"type": "object", "properties": {"x": {"type": "blob"}}})),
        {},
        400,
    ),
    ("tool-name-spaces", "POST", CHAT, chat(tools=[{"type": "function", "function": {"name": "rm -rf /"}}]), {}, 400),
    (
        "tool-choice-unknown",
        "POST",
        CHAT,
        chat(tools=weather({"type": "object"}), tool_choice={"type": "function", "function": {"name": "nope"}}),
        {},
        400,
    ),
    ("tool-choice-without-tools", "POST", CHAT, chat(tool_choice="required"), {}, 400),
    (
        "tool-call-arguments-not-json",
        "POST",
        CHAT,
        chat(
            messages=USER
            + [
                {
                    "role": "assistant",
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                    ],
                }
            ]
        ),
        {},
        400,
    ),
    ("reasoning-effort-unknown", "POST", CHAT, chat(reasoning_effort="extreme"), {}, 400),
    ("too-many-stops", "POST", CHAT, chat(stop=[str(i) for i in range(100)]), {}, 400),
    ("session-id-path", "POST", CHAT, chat(session_id="../../etc/passwd"), {}, 400),
    ("context-overflow", "POST", CHAT, chat(messages=[{"role": "user", "content": "word " * 2000}]), {}, 400),
    ("deep-nesting", "POST", CHAT, deep(20000), {}, 400),
    (
        "ten-megabytes",
        "POST",
        CHAT,
        b'{"model": "default", "messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}',
        {},
        413,
    ),
    (
        "completion-ids-out-of-range",
        "POST",
        COMPLETIONS,
        {"model": "default", "prompt": [10**9], "max_tokens": 2},
        {},
        400,
    ),
    ("completion-no-prompt", "POST", COMPLETIONS, {"model": "default"}, {}, 400),
    ("completion-echo", "POST", COMPLETIONS, {"model": "default", "prompt": "a", "echo": True}, {}, 400),
    ("anthropic-no-max-tokens", "POST", MESSAGES, {"model": "default", "messages": USER}, {}, 400),
    (
        "anthropic-image",
        "POST",
        MESSAGES,
        {
            "model": "default",
            "max_tokens": 4,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                    ],
                }
            ],
        },
        {},
        400,
    ),
    (
        "anthropic-budget-over-max",
        "POST",
        MESSAGES,
        {"model": "default", "max_tokens": 8, "messages": USER, "thinking": {"type": "enabled", "budget_tokens": 64}},
        {},
        400,
    ),
    (
        "anthropic-tool-result-from-assistant",
        "POST",
        MESSAGES,
        {
            "model": "default",
            "max_tokens": 4,
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x", "content": "y"}]}
            ],
        },
        {},
        400,
    ),
    (
        "anthropic-unknown-block",
        "POST",
        MESSAGES,
        {"model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "hologram"}]}]},
        {},
        400,
    ),
    ("wrong-method", "GET", CHAT, None, {}, 405),
    ("unknown-path", "POST", "/v1/engines/davinci", chat(), {}, 404),
    ("missing-session", "GET", "/v1/sessions/none-such", None, {}, 404),
]


@pytest.fixture(scope="module")
def http(tiny_server):
    with httpx.Client(base_url=tiny_server.url, timeout=120) as client:
        yield client


def _send(http, method, path, body, headers):
    if isinstance(body, dict):
        content, kind = json.dumps(body).encode(), "application/json"
    else:
        content, kind = (body.encode() if isinstance(body, str) else body), "application/json"
    return http.request(method, path, content=content, headers={"content-type": kind, **headers})


def test_there_are_at_least_25_cases():
    assert len(CASES) >= 25 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_hostile_request_gets_a_4xx_json_error(http, case):
    _, method, path, body, headers, status = case
    response = _send(http, method, path, body, headers)
    assert response.status_code == status, response.text[:500]
    error = response.json()
    if path == MESSAGES:
        assert error["type"] == "error" and error["error"]["message"]
    else:
        assert error["error"]["message"] and error["error"]["type"]
    ok = http.post(CHAT, json=chat(max_tokens=2, temperature=0))  # still serving
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_context_overflow_names_the_limit(http):
    response = http.post(CHAT, json=chat(messages=[{"role": "user", "content": "word " * 2000}]))
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_long_tool_outputs_are_compressed_to_fit(http):
    """A conversation over the context because of a tool output still runs: the output is shortened."""
    call = {"id": "c1", "type": "function", "function": {"name": "read", "arguments": "{}"}}
    messages = USER + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "line of output " * 400},
    ]
    response = http.post(CHAT, json=chat(messages=messages, max_tokens=2))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] < 512


@pytest.fixture(scope="module")
def keyed_server(tiny_model, tmp_path_factory):
    server = start_server(
        tiny_model, tmp_path_factory.mktemp("keyed"), "--api-key", "s3cret", "--no-sessions", "--max-context", "256"
    )
    yield server
    server.stop()


@pytest.mark.parametrize(
    "headers, status",
    [
        ({}, 401),
        ({"authorization": "Bearer wrong"}, 401),
        ({"x-api-key": "wrong"}, 401),
        ({"authorization": "Basic czNjcmV0"}, 401),
        ({"authorization": "Bearer s3cret"}, 200),
        ({"x-api-key": "s3cret"}, 200),
    ],
    ids=["missing", "wrong-bearer", "wrong-x-api-key", "basic", "bearer", "x-api-key"],
)
def test_api_key(keyed_server, headers, status):
    response = httpx.post(keyed_server.url + CHAT, json=chat(max_tokens=2), headers=headers, timeout=60)
    assert response.status_code == status, response.text
    if status == 401:
        assert "API key" in response.json()["error"]["message"]
    models = httpx.get(keyed_server.url + "/v1/models", headers=headers, timeout=60)
    assert models.status_code == status
    assert httpx.get(keyed_server.url + "/health", timeout=60).status_code == 200
