"""Images through every API, over a real server on the tiny Kimi K2.5 checkpoint (MoonViT tower, Jinja template):
OpenAI `image_url` parts (data and file URLs), Responses `input_image`, Anthropic `image` blocks, with the official
SDKs; sessions keep the images by hash and re-render them; hostile image inputs get a 4xx and nothing is read
outside the documents root; a model without a vision tower answers 400."""

from __future__ import annotations

import base64
import io
import json
import re

import httpx
import numpy as np
import pytest
from PIL import Image

from tests.server.conftest import start_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.slow


def png(seed: int, size=(60, 40), fmt: str = "PNG") -> bytes:
    arr = np.random.default_rng(seed).integers(0, 256, size=(size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format=fmt)
    return buf.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


A, B = png(1), png(2)
TOKENS_60x40 = 6  # 40x60 px -> 4x6 patches of 14 px (padded to 56x84) -> 2x3 merged rows
CHAT_BODY = {"model": "default", "max_tokens": 4}


@pytest.fixture(scope="module")
def k25(tmp_path_factory):
    from localmoe.testing import write_checkpoint

    return write_checkpoint("kimi_k25", tmp_path_factory.mktemp("k25"), "tiny", seed=0)


@pytest.fixture(scope="module")
def roots(tmp_path_factory):
    base = tmp_path_factory.mktemp("images")
    root, outside = base / "docs", base / "private"
    root.mkdir()
    outside.mkdir()
    (root / "a.png").write_bytes(A)
    (outside / "secret.png").write_bytes(B)
    (root / "link.png").symlink_to(outside / "secret.png")
    (root / "notes.txt").write_text("not an image")
    return root, outside


@pytest.fixture(scope="module")
def server(k25, roots, tmp_path_factory):
    directory = tmp_path_factory.mktemp("vision-server")
    srv = start_server(k25, directory, "--max-context", "512", "--sessions", str(directory / "sessions.db"),
                       "--documents-root", str(roots[0]), "--max-tokens", "8")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def an(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics").text
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def openai_chat(oa, image: bytes, text: str = "what is this?", **extra):
    content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": text}]
    return oa.chat.completions.create(model="default", temperature=0, max_tokens=8,
                                      messages=[{"role": "user", "content": content}], **extra)


def test_the_three_apis_show_the_model_the_same_image(oa, an, server):
    text_only = oa.chat.completions.create(model="default", temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "what is this?"}])
    encoded = metric(server, "localmoe_images_encoded_total")
    chat = openai_chat(oa, A)
    # the placeholder rows plus <|media_begin|>image<|media_content|> ... <|media_end|>
    assert chat.usage.prompt_tokens > text_only.usage.prompt_tokens + TOKENS_60x40
    assert metric(server, "localmoe_images_encoded_total") == encoded + 1
    assert metric(server, "localmoe_image_encode_seconds_total") > 0
    responses = oa.responses.create(model="default", temperature=0, max_output_tokens=8, store=False, input=[
        {"role": "user", "content": [{"type": "input_image", "image_url": data_url(A)},
                                     {"type": "input_text", "text": "what is this?"}]}])
    message = an.messages.create(model="default", max_tokens=8, extra_body={"temperature": 0}, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                  "data": base64.b64encode(A).decode()}},
                                     {"type": "text", "text": "what is this?"}]}])
    assert chat.choices[0].message.content == responses.output_text == message.content[0].text
    assert chat.usage.prompt_tokens == responses.usage.input_tokens == message.usage.input_tokens + \
        (message.usage.cache_read_input_tokens or 0)
    assert metric(server, "localmoe_images_encoded_total") == encoded + 1  # the same content: encoded once
    other = openai_chat(oa, B)
    assert other.usage.prompt_tokens == chat.usage.prompt_tokens  # same size, same placeholders
    assert other.choices[0].message.content != chat.choices[0].message.content  # the tower's rows reach the model


def test_file_url_under_the_documents_root(oa, roots):
    by_file = oa.chat.completions.create(model="default", temperature=0, max_tokens=8, messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": (roots[0] / "a.png").as_uri()}},
                                     {"type": "text", "text": "what is this?"}]}])
    assert by_file.choices[0].message.content == openai_chat(oa, A).choices[0].message.content


def test_a_session_keeps_its_images_once_and_renders_them_again(oa, server):
    first = openai_chat(oa, A, extra_body={"session_id": "img-1"})
    again = oa.chat.completions.create(model="default", temperature=0, max_tokens=8, extra_body={"session_id": "img-1"},
                                       messages=[{"role": "user", "content": "and again?"}])
    assert again.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens  # image included
    openai_chat(oa, A, extra_body={"session_id": "img-1"})  # the same image again: stored once
    stored = httpx.get(server.url + "/v1/sessions/img-1").json()["messages"]
    shown = [image["sha256"] for m in stored for image in m.get("images", [])]
    assert len(shown) == 2 and len(set(shown)) == 1
    assert stored[0]["images"][0]["offset"] == 0 and stored[0]["images"][0]["bytes"] == len(A)


WIDE = png(3, (20_000, 1))
NOT_IMAGE = data_url(b"GIF89a but not really an image at all")
TRUNCATED = data_url(png(4)[:200])


def bomb() -> bytes:
    """A small PNG file that claims 30,000 x 30,000 pixels (a decompression bomb)."""
    buf = io.BytesIO()
    Image.new("1", (30_000, 30_000)).save(buf, format="PNG")
    return buf.getvalue()


def image_part(url: str) -> list[dict]:
    return [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]


def chat_with(content, role: str = "user") -> dict:
    return {**CHAT_BODY, "messages": [{"role": role, "content": content}]}


def anthropic_with(source: dict) -> dict:
    return {**CHAT_BODY, "messages": [{"role": "user", "content": [{"type": "image", "source": source},
                                                                   {"type": "text", "text": "hi"}]}]}


HOSTILE = [  # (id, path, body, expected status, a word the error names)
    ("not-an-image", "/v1/chat/completions", lambda r: chat_with(image_part(NOT_IMAGE)), 400, "not a readable image"),
    ("truncated", "/v1/chat/completions", lambda r: chat_with(image_part(TRUNCATED)), 400, "not a readable image"),
    ("20000-px-wide", "/v1/chat/completions", lambda r: chat_with(image_part(data_url(WIDE))), 400, "too large"),
    ("decompression-bomb", "/v1/chat/completions", lambda r: chat_with(image_part(data_url(bomb()))), 400,
     "decompression bomb"),
    ("too-many", "/v1/chat/completions", lambda r: chat_with(image_part(data_url(A)) * 65), 400, "more than the 64"),
    ("bad-base64", "/v1/chat/completions", lambda r: chat_with(image_part("data:image/png;base64,@@@not base64")),
     400, "base64"),
    ("not-base64-data-url", "/v1/chat/completions", lambda r: chat_with(image_part("data:image/png,rawbytes")), 400,
     "base64"),
    ("not-an-image-type", "/v1/chat/completions",
     lambda r: chat_with(image_part("data:text/html;base64," + base64.b64encode(b"<p>").decode())), 400, "media type"),
    ("http-url", "/v1/chat/completions", lambda r: chat_with(image_part("http://127.0.0.1:9/x.png")), 400,
     "no network fetches"),
    ("path-outside-root", "/v1/chat/completions",
     lambda r: chat_with(image_part((r[1] / "secret.png").as_uri())), 403, "outside"),
    ("dot-dot-escape", "/v1/chat/completions",
     lambda r: chat_with(image_part(r[0].as_uri() + "/../private/secret.png")), 403, "outside"),
    ("symlink-out-of-root", "/v1/chat/completions", lambda r: chat_with(image_part((r[0] / "link.png").as_uri())),
     403, "outside"),
    ("file-with-host", "/v1/chat/completions", lambda r: chat_with(image_part("file://evil.example/etc/passwd")),
     400, "no host"),
    ("text-file-under-root", "/v1/chat/completions", lambda r: chat_with(image_part((r[0] / "notes.txt").as_uri())),
     400, "not a readable image"),
    ("missing-file", "/v1/chat/completions", lambda r: chat_with(image_part((r[0] / "none.png").as_uri())), 400,
     "no such image file"),
    ("image-in-assistant", "/v1/chat/completions", lambda r: chat_with(image_part(data_url(A)), "assistant"), 400,
     "text"),
    ("anthropic-bad-base64", "/v1/messages",
     lambda r: anthropic_with({"type": "base64", "media_type": "image/png", "data": "!!!"}), 400, "base64"),
    ("anthropic-url-source", "/v1/messages",
     lambda r: anthropic_with({"type": "url", "url": "https://example.com/a.png"}), 400, "no network fetches"),
    ("anthropic-media-type", "/v1/messages",
     lambda r: anthropic_with({"type": "base64", "media_type": "application/pdf", "data": "AAAA"}), 400, "media type"),
    ("responses-file-id", "/v1/responses", lambda r: {"model": "default", "input": [
        {"role": "user", "content": [{"type": "input_image", "file_id": "file-123"}]}]}, 400, "image URL"),
]


@pytest.mark.parametrize(("path", "body", "status", "named"), [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_images_get_a_4xx(server, roots, path, body, status, named):
    r = httpx.post(server.url + path, json=body(roots), timeout=60)
    assert r.status_code == status, r.text
    assert named in r.text
    assert r.json()["error"]["message"]
    assert "secret" not in r.text or "secret.png" in json.dumps(body(roots))  # nothing read outside is echoed
    assert httpx.get(server.url + "/health").status_code == 200


def test_a_text_model_refuses_images(tiny_server):
    r = httpx.post(tiny_server.url + "/v1/chat/completions", json=chat_with(image_part(data_url(A))), timeout=60)
    assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
    r = httpx.post(tiny_server.url + "/v1/messages", json=anthropic_with(
        {"type": "base64", "media_type": "image/png", "data": base64.b64encode(A).decode()}), timeout=60)
    assert r.status_code == 400 and "no vision tower" in r.json()["error"]["message"]
