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


def test_a_burst_with_one_header_prefills_it_once(embedded, monkeypatch):
    """Requests with the same header submitted together: the first prefills the header and leaves a copy of it in the
    prefix cache as its prompt passes it; the others wait that step and start from a copy each, so the header's rows
    run once (counted), and every answer equals its answer alone. A later burst larger than the prefix cache's
    entries takes the header from them, every request (an entry is copied to each, not handed to one). Every
    finished request's blocks are released (the worker's running caches hold none)."""
    from localmoe.engine.generate import Decoder
    from localmoe.runtime.turn import run_chat
    from localmoe.runtime.worker import Job

    rows = []
    take = Decoder.take_prompt
    monkeypatch.setattr(Decoder, "take_prompt", lambda self, limit: rows.append(take(self, limit)) or rows[-1])
    service = Service(embedded, ServerConfig(prefix_cache_entries=2))
    fmt, tok, model = service.format, service.tokenizer, service.model

    def burst(texts: list[str]):
        results, preps = {}, []

        def on_event(i: int):
            return lambda kind, payload: results.__setitem__(i, payload) if kind == "done" else None

        for i, text in enumerate(texts):
            request = ChatRequest([ChatMessage("user", text)], 8, SamplingParams(temperature=0.0), tools=TOOLS)
            preps.append(prep := service.prepare_chat(request)[0])
            service.worker.submit(Job(lambda job, p=prep: run_chat(fmt, tok, model, p, job.emit, lambda: job.cancelled),
                                      on_event(i)))
        rows.clear()
        while len(results) < len(texts) or service.worker.active:
            service.worker.step()
        assert service.worker.kv_bytes == 0
        return [results[i] for i in range(len(texts))], preps, sum(len(r) for r in rows)

    texts = ["What is in notes.txt?", "Who are you?", "Read setup.py.", "Is there a README?"]
    first, preps, ran = burst(texts)
    anchor = preps[0].anchor
    assert anchor is not None and all(p.anchor == anchor for p in preps)
    assert [r.cached_tokens for r in first] == [0] + [anchor] * 3
    assert ran == sum(len(p.prompt) for p in preps) - 3 * anchor  # the header's rows once
    later, preps, ran = burst(texts + ["List the files."])  # 5 requests, 2 entries
    assert [r.cached_tokens for r in later] == [anchor] * 5 and ran == sum(len(p.prompt) - anchor for p in preps)
    cold = Service(embedded, ServerConfig(prefix_cache_entries=0))
    for text, a, b in zip(texts + ["List the files."], first + [None], later):
        alone, _ = answer(cold, text)
        assert alone.cached_tokens == 0
        for result in (a, b):
            if result is not None:
                assert result.content == alone.content
                assert [(c.name, c.arguments) for c in result.tool_calls] == \
                    [(c.name, c.arguments) for c in alone.tool_calls]
