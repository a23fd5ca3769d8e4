"""An error after a stream has started ends the stream with the API's error event (OpenAI: an
`error` chunk, Anthropic: an `error` event), never a cut connection; a non-streamed request
that fails inside the engine gets a JSON error. The engine is made to fail on purpose: the
model's forward raises on its third call, with the worker's batched step and without. Greedy requests: a sampled
first token can be the end of the turn, and the stream then ends before the third call (a flaky test)."""

from __future__ import annotations

import anthropic
import openai
import pytest
from fastapi.testclient import TestClient

USER = [{"role": "user", "content": "Tell me a story."}]


class Boom(RuntimeError):
    pass


@pytest.fixture(scope="module", params=["off", "on"])
def failing(request, tiny_model):
    """A TestClient over a Service whose model raises on every third forward pass: its own forward (the prompt, and
    every decode step with batching off) or the batched step's (batching on: engine/batch.py `forward_rows`, which
    runs the rows plan)."""
    from localmoe.engine import batch, prompt_rows  # noqa: F401 (imported before the patch: they hold the original)
    from localmoe.engine.spec import drafters, verify  # noqa: F401
    from localmoe.load import load_model
    from localmoe.runtime.service import ServerConfig, Service
    from localmoe.server.app import create_app

    loaded = load_model(tiny_model)
    calls = [0]

    def flaky(fn):
        def call(*args, **kwargs):
            calls[0] += 1
            if calls[0] % 3 == 0:
                raise Boom("the expert store went away")
            return fn(*args, **kwargs)
        return call

    forward, forward_rows = loaded.model.forward, batch.forward_rows
    loaded.model.forward, batch.forward_rows = flaky(forward), flaky(forward_rows)
    try:
        service = Service(loaded, ServerConfig(threads=1, prefix_cache_entries=0, batching=request.param))
        with TestClient(create_app(service), base_url="http://localhost", raise_server_exceptions=False) as client:
            yield client, calls
    finally:
        loaded.model.forward, batch.forward_rows = forward, forward_rows


def test_openai_stream_ends_with_an_error_chunk(failing):
    client, calls = failing
    calls[0] = 0
    sdk = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=client, max_retries=0)
    got: list = []
    with pytest.raises(openai.APIError) as info:
        got.extend(sdk.chat.completions.create(model="default", messages=USER, max_tokens=8, stream=True,
                                                        temperature=0))
    assert not isinstance(info.value, openai.APIConnectionError)
    assert "Boom" in str(info.value.message) and got  # the stream had started
    raw = client.post("/v1/chat/completions", json={"model": "default", "messages": USER, "max_tokens": 8,
                                                    "stream": True, "temperature": 0})
    events = [line for line in raw.text.splitlines() if line.startswith("data: ")]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


def test_anthropic_stream_ends_with_an_error_event(failing):
    client, calls = failing
    calls[0] = 0
    sdk = anthropic.Anthropic(base_url="http://localhost", api_key="x", http_client=client, max_retries=0)
    with pytest.raises(anthropic.APIStatusError) as info, sdk.messages.stream(
            model="default", max_tokens=8, messages=USER, extra_body={"temperature": 0}) as stream:
        for _ in stream:
            pass
    assert "Boom" in str(info.value)
    calls[0] = 0
    raw = client.post("/v1/messages", json={"model": "default", "messages": USER, "max_tokens": 8, "stream": True,
                                            "temperature": 0})
    assert raw.text.startswith("event: message_start") and "event: error\n" in raw.text


def test_completion_stream_and_plain_requests_get_json_errors(failing):
    client, calls = failing
    calls[0] = 0
    raw = client.post("/v1/completions", json={"model": "default", "prompt": "Once", "max_tokens": 8,
                                               "stream": True, "temperature": 0})
    assert '"error"' in raw.text and raw.text.rstrip().endswith("data: [DONE]")
    calls[0] = 0
    plain = client.post("/v1/chat/completions", json={"model": "default", "messages": USER, "max_tokens": 8})
    assert plain.status_code == 500 and "Boom" in plain.json()["error"]["message"]
    calls[0] = 1  # the next forward succeeds: the server goes on serving
    assert client.get("/health").status_code == 200


def test_responses_stream_ends_with_an_error_event(failing):
    client, calls = failing
    calls[0] = 0
    sdk = openai.OpenAI(base_url="http://localhost/v1", api_key="x", http_client=client, max_retries=0)
    events = list(sdk.responses.create(model="default", input="Tell me a story.", max_output_tokens=8, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "error" and "Boom" in events[-1].message
