"""Speculative decoding per request over HTTP (`spec`, a localmoe extension): a request may ask for
prompt lookup on a server started without it (same greedy answer as off), /metrics then counts its
drafts, and a draft model the server did not load is a 400 naming `spec`."""

from __future__ import annotations

import httpx

QUOTE = "Repeat exactly: the pager keeps the hot experts in RAM slots and reads the others from the drive."


def test_spec_per_request(tiny_server):
    answers = {}
    for spec in ("off", "prompt"):
        body = {"model": "default", "max_tokens": 16, "temperature": 0, "spec": spec,
                "messages": [{"role": "user", "content": QUOTE}]}
        r = httpx.post(tiny_server.url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        answers[spec] = r.json()["choices"][0]["message"]["content"]
    assert answers["prompt"] == answers["off"]
    metrics = httpx.get(tiny_server.url + "/metrics", timeout=30).text
    steps = [line for line in metrics.splitlines() if line.startswith("localmoe_spec_steps_total ")]
    assert steps and float(steps[0].split()[1]) > 0, metrics
    for spec in ("draft", "prompt+draft"):  # the server loaded no draft model
        r = httpx.post(tiny_server.url + "/v1/completions", timeout=120,
                       json={"model": "default", "prompt": QUOTE, "max_tokens": 4, "spec": spec})
        assert r.status_code == 400 and r.json()["error"]["param"] == "spec", r.text
    r = httpx.post(tiny_server.url + "/v1/completions", timeout=120,
                   json={"model": "default", "prompt": QUOTE, "max_tokens": 4, "spec": "lookahead"})
    assert r.status_code in (400, 422)
