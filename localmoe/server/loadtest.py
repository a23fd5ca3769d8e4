"""Load a running server with concurrent clients and report throughput.

    python -m localmoe.server.loadtest http://127.0.0.1:8000 --clients 16 --requests 8 --max-tokens 16

Each client sends its requests one after another (half of them streamed); the report is
requests/s, aggregate generated tokens/s, and latency percentiles, as one JSON line.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import click

PROMPTS = ["Tell me about experts.", "What is a router?", "Describe NVMe.", "Hello there!"]


def _one(client, model: str, k: int, max_tokens: int, stream: bool) -> tuple[int, float]:
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0.8, "seed": k,
            "messages": [{"role": "user", "content": PROMPTS[k % len(PROMPTS)]}]}
    started = time.perf_counter()
    if stream:
        tokens = 0
        with client.stream("POST", "/v1/chat/completions",
                           json={**body, "stream": True, "stream_options": {"include_usage": True}}) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if line.startswith("data: {") and '"usage"' in line:
                    usage = json.loads(line[6:]).get("usage")
                    tokens = usage["completion_tokens"] if usage else tokens
    else:
        response = client.post("/v1/chat/completions", json=body)
        response.raise_for_status()
        tokens = response.json()["usage"]["completion_tokens"]
    return tokens, time.perf_counter() - started


def run_load(url: str, clients: int = 16, requests: int = 8, max_tokens: int = 16, model: str = "default",
             api_key: str | None = None) -> dict:
    """Run the load; returns the figures."""
    import httpx

    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}

    def client_run(c: int) -> list[tuple[int, float]]:
        with httpx.Client(base_url=url, timeout=3600, headers=headers) as client:
            return [_one(client, model, c * requests + j, max_tokens, (c + j) % 2 == 0) for j in range(requests)]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        results = [r for rs in pool.map(client_run, range(clients)) for r in rs]
    seconds = time.perf_counter() - started
    latencies = sorted(s for _, s in results)
    tokens = sum(t for t, _ in results)
    return {"clients": clients, "requests": len(results), "seconds": round(seconds, 2),
            "requests_per_s": round(len(results) / seconds, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 2), "latency_p50_s": round(statistics.median(latencies), 3),
            "latency_max_s": round(latencies[-1], 3)}


@click.command()
@click.argument("url")
@click.option("--clients", type=int, default=16, show_default=True)
@click.option("--requests", type=int, default=8, show_default=True, help="Requests per client.")
@click.option("--max-tokens", type=int, default=16, show_default=True)
@click.option("--model", default="default", show_default=True)
@click.option("--api-key", default=None)
def main(url, clients, requests, max_tokens, model, api_key):
    """Load the server at URL and print throughput as JSON."""
    figures = run_load(url, clients, requests, max_tokens, model, api_key)
    json.dump(figures, sys.stdout)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
