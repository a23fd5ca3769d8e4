"""A stream the client cuts keeps what was already streamed: the partial answer joins the
session, marked interrupted, and the next turn sees it."""

from __future__ import annotations

import json
import time

import httpx


def test_cut_stream_saves_the_partial_answer(real_server):
    session = f"cut-{time.time_ns()}"
    body = {"model": "default", "stream": True, "max_tokens": 64, "temperature": 0, "session_id": session,
            "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]}
    seen = ""
    with httpx.Client(timeout=120) as client, client.stream("POST", real_server.url + "/v1/chat/completions",
                                                            json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen += json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            if len(seen) > 20:
                break  # the client goes away mid-answer
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        stored = httpx.get(f"{real_server.url}/v1/sessions/{session}", timeout=30).json()["messages"]
        if stored[-1]["role"] == "assistant":
            break
        time.sleep(0.2)
    last = stored[-1]
    assert last["role"] == "assistant" and last.get("interrupted") is True, stored
    assert last["content"].startswith(seen) and len(seen) > 20
    whole = httpx.post(real_server.url + "/v1/chat/completions", timeout=120, json={
        **body, "stream": False, "session_id": f"{session}-whole"}).json()["choices"][0]["message"]["content"]
    assert len(last["content"]) < len(whole)  # cut short, not the whole answer
    follow = httpx.post(real_server.url + "/v1/chat/completions", timeout=120, json={
        "model": "default", "max_tokens": 2, "session_id": session, "messages": [{"role": "user", "content": "Go on."}]})
    assert follow.status_code == 200 and follow.json()["usage"]["prompt_tokens"] > 20
