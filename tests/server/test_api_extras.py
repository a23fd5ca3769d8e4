"""`models.retrieve` (both SDKs), Anthropic `models.list` fields, `messages.count_tokens` against the
prompt a following `messages.create` reports, and sampling fields through the anthropic SDK's
`extra_body` (SDK 2.x has no `temperature` argument on `messages.create`)."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

TOOLS = [{"name": "get_weather", "description": "Current weather of a city.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.fixture(scope="module")
def clients(real_server):
    return (openai.OpenAI(base_url=real_server.url + "/v1", api_key="x", max_retries=0),
            anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0))


def test_models_retrieve_and_404(clients, real_server):
    oai, ant = clients
    listed = oai.models.list().data
    assert len(listed) == 1
    name = listed[0].id
    assert oai.models.retrieve(name).id == name and oai.models.retrieve("default").id == name
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-17")
    info = ant.models.retrieve(name)
    assert info.type == "model" and info.display_name == name and info.created_at.year >= 2024
    page = ant.models.list()
    assert [m.id for m in page.data] == [name] and page.data[0].display_name and page.data[0].created_at
    with pytest.raises(anthropic.NotFoundError):
        ant.models.retrieve("claude-none")
    missing = httpx.get(real_server.url + "/v1/models/nope", timeout=30)
    assert missing.status_code == 404 and "nope" in missing.json()["error"]["message"]


@pytest.mark.parametrize("extra", [{}, {"system": "Be terse."}, {"tools": TOOLS},
                                   {"output_config": {"effort": "low"}}], ids=["plain", "system", "tools", "effort"])
def test_count_tokens_equals_what_create_reports(clients, extra):
    _, ant = clients
    messages = [{"role": "user", "content": "What is the weather like in Paris in spring?"}]
    counted = ant.messages.count_tokens(model="default", messages=messages, **extra).input_tokens
    reply = ant.messages.create(model="default", max_tokens=4, messages=messages, extra_body={"temperature": 0},
                                **extra)
    assert counted == reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
    assert counted > 10


def test_count_tokens_refuses_bad_bodies(real_server):
    url = real_server.url + "/v1/messages/count_tokens"
    assert httpx.post(url, json={"model": "default"}, timeout=30).status_code == 400
    assert httpx.post(url, json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
                      timeout=30).status_code == 404


def test_sampling_fields_through_extra_body(clients):
    _, ant = clients
    messages = [{"role": "user", "content": "Write a word."}]

    def ask(**sampling):
        reply = ant.messages.create(model="default", max_tokens=12, messages=messages, extra_body=sampling)
        return reply.content[0].text

    assert ask(temperature=1.0, seed=7) == ask(temperature=1.0, seed=7)  # the seed is applied
    assert ask(temperature=0) == ask(temperature=0, top_k=1)
    texts = {ask(temperature=1.0, seed=s, top_p=1.0) for s in range(4)}
    assert len(texts) > 1  # temperature reached the sampler
    with pytest.raises(anthropic.BadRequestError):
        ask(temperature=5)
