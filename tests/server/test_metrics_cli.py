"""/metrics in the Prometheus text format, and the `localmoe serve` command registration."""

from __future__ import annotations

import re

import httpx
from click.testing import CliRunner

from localmoe.cli import cli


def _samples(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_metrics_are_prometheus_text_and_count_requests(tiny_server):
    before = _samples(httpx.get(tiny_server.url + "/metrics", timeout=30).text)
    reply = httpx.post(
        tiny_server.url + "/v1/chat/completions",
        timeout=60,
        json={"model": "default", "max_tokens": 5, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]},
    )
    usage = reply.json()["usage"]
    response = httpx.get(tiny_server.url + "/metrics", timeout=30)
    assert response.headers["content-type"].startswith("text/plain")
    text = response.text
    for name in (
        "localmoe_generation_tokens_per_second",
        "localmoe_queue_depth",
        "localmoe_active_generations",
        "localmoe_time_to_first_token_seconds",
        "localmoe_expert_tier_hit_rate",
    ):
        assert re.search(rf"^# TYPE {name} (gauge|counter|histogram)$", text, re.MULTILINE), name
    after = _samples(text)
    key = 'localmoe_requests_total{path="/v1/chat/completions",status="200"}'
    assert after[key] == before.get(key, 0) + 1
    assert (
        after["localmoe_generation_tokens_total"] - before["localmoe_generation_tokens_total"]
        == usage["completion_tokens"]
    )
    assert after["localmoe_prompt_tokens_total"] - before["localmoe_prompt_tokens_total"] == usage["prompt_tokens"]
    assert (
        after['localmoe_time_to_first_token_seconds_bucket{le="+Inf"}']
        == after["localmoe_time_to_first_token_seconds_count"]
    )


def test_serve_is_a_registered_command():
    result = CliRunner().invoke(cli, ["serve", "--help"])
    assert result.exit_code == 0
    for option in ("--host", "--port", "--api-key", "--thinking-budgets", "--sessions"):
        assert option in result.output
    assert "127.0.0.1" in result.output


def test_serve_rejects_bad_budgets():
    result = CliRunner().invoke(cli, ["serve", "--thinking-budgets", "medium=3", "--no-sessions"])
    assert result.exit_code == 1 and "thinking budget tier" in result.output
