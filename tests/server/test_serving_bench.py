"""benchmarks/serving.py's clients: where the chat reply streams no text for the tokens it generates (a random-weight
gpt-oss store writes no harmony channel header, so the chat parser holds every token), the runs use plain completions
and their latencies are numbers, not NaN; a chat reply that streams text keeps the chat API. The server is faked
(httpx.MockTransport): what it streams is what `localmoe serve` streams for each case."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import httpx

SERVING = Path(__file__).resolve().parents[2] / "benchmarks" / "serving.py"


def load():
    spec = importlib.util.spec_from_file_location("serving_bench", SERVING)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def server(chat_text: bool) -> httpx.Client:
    """A fake server: chat chunks carry text only where `chat_text` (else the role chunk, then usage only);
    completion chunks carry each token's text."""
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        n = body["max_tokens"]
        if request.url.path == "/v1/chat/completions":
            chunks = [{"choices": [{"index": 0, "delta": {"role": "assistant"}}]}]
            chunks += [{"choices": [{"index": 0, "delta": {"content": "x" if chat_text else ""}}]} for _ in range(n)]
        else:
            assert "prompt" in body and "messages" not in body
            chunks = [{"choices": [{"index": 0, "text": f" t{i}"}]} for i in range(n)]
        chunks.append({"choices": [], "usage": {"completion_tokens": n}})
        text = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.Client(transport=httpx.MockTransport(handle), base_url="http://server")


def test_a_chat_reply_without_text_measures_latencies_through_completions():
    serving = load()
    with server(chat_text=False) as client:
        held = serving.one(client, 0, 8, "chat")
        assert held["tokens"] == 8 and math.isnan(held["ttft"]) and held["gaps"] == []  # the NaN of paged serving
        api, why = serving.pick_api(client, "auto")
        assert api == "completions" and why
        got = serving.one(client, 1, 8, api)
    assert got["tokens"] == 8 and len(got["gaps"]) == 7 and not math.isnan(got["ttft"])


def test_a_chat_reply_with_text_keeps_the_chat_api():
    serving = load()
    with server(chat_text=True) as client:
        assert serving.pick_api(client, "auto") == ("chat", None)
        assert serving.pick_api(client, "completions") == ("completions", None)
        got = serving.one(client, 0, 8, "chat")
    assert got["tokens"] == 8 and len(got["gaps"]) == 7 and not math.isnan(got["ttft"])
