"""A conversation's fixed header (system message, tool definitions) ends a prompt chunk, so it is
prefilled once and reused by every request with the same header, with the output unchanged: a front
end warms it while the user types (`Service.warm`), and a request then prefills only its own message."""

from __future__ import annotations

import pytest

from localmoe.chat import ChatMessage
from localmoe.engine.prefix_cache import is_boundary, shared_boundaries
from localmoe.engine.sampler import SamplingParams
from localmoe.runtime.service import ChatRequest, ServerConfig, Service

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a text file.", "parameters": {
    "type": "object", "properties": {"path": {"type": "string", "description": "Relative path."}},
    "required": ["path"]}}}]


def test_shared_boundaries_are_chunk_ends_of_both_prompts():
    for a, b in ((None, None), (400, 400), (600, 600), (400, None), (700, 900)):
        points = shared_boundaries(1300, 512, a, b)
        assert points == sorted(points, reverse=True) and points[-1] == 0
        assert all(is_boundary(p, 512, a) and is_boundary(p, 512, b) for p in points)
    assert shared_boundaries(1300, 512, 400, 400)[:2] == [912, 400]
    assert shared_boundaries(1300, 512, 400, None) == [0]


@pytest.fixture(scope="module")
def embedded():
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    return load_model(None, EngineConfig(threads=1), progress=False)


def answer(service: Service, text: str):
    request = ChatRequest([ChatMessage("user", text)], 8, SamplingParams(temperature=0.0), tools=TOOLS)
    (result,) = [p for kind, p in service.chat_here(request) if kind == "done"]
    return result, service.prepare_chat(request)[0]


def test_a_warmed_header_is_reused_and_the_answer_is_unchanged(embedded):
    service = Service(embedded, ServerConfig())
    request = ChatRequest([ChatMessage("user", "...")], 8, SamplingParams(temperature=0.0), tools=TOOLS)
    service.warm(request)
    while service.worker.waiting or service.worker.active:
        service.worker.step()
    warmed, prep = answer(service, "What is in notes.txt?")
    assert prep.anchor is not None and warmed.cached_tokens == prep.anchor  # the header was not prefilled again
    again, _ = answer(service, "Who are you?")  # the first answer left its cache: the header is reused again
    assert again.cached_tokens == prep.anchor
    cold = Service(embedded, ServerConfig(prefix_cache_entries=0))
    for text, result in (("What is in notes.txt?", warmed), ("Who are you?", again)):
        alone, _ = answer(cold, text)
        assert alone.cached_tokens == 0 and alone.content == result.content
        assert [(c.name, c.arguments) for c in alone.tool_calls] == [(c.name, c.arguments) for c in result.tool_calls]
