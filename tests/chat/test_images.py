"""Images in conversations: content parts -> ImageRefs at text offsets, each format's placeholder (K3 XTML with
`image WxH`, the Kimi K2.5 template's media tokens, harmony refusing), and sessions keeping images once by hash."""

from __future__ import annotations

import json
import shutil

import pytest

from localmoe.chat import ChatFormatError, ChatMessage, HarmonyFormat, JinjaFormat, XtmlFormat, messages_from_openai
from localmoe.chat.images import KIMI_MEDIA, ImageRef
from localmoe.chat.sessions import SessionStore

PNG_A, PNG_B = b"\x89PNG fake a", b"\x89PNG fake b"  # the chat layer never decodes: bytes are enough


def sized(data: bytes, offset: int, tokens: int = 3) -> ImageRef:
    """A ref as the runtime leaves it for a tower that sees 28 x 42 pixels as `tokens` rows."""
    return ImageRef(ImageRef.of(data).sha256, data, offset, 28, 42, tokens)


@pytest.fixture(scope="module")
def k3_media_tokenizer(tmp_path_factory):
    """The tiny K3 tokenizer with four reserved specials renamed to the Kimi media tokens (as K3's release has)."""
    from localmoe.testing import write_checkpoint
    from localmoe.tokenizer import tokenizer_from_hf_dir

    path = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3m"), size="tiny")
    text = (path / "tokenizer.json").read_text()
    for k, name in enumerate(KIMI_MEDIA):
        text = text.replace(f'"<|reserved_token_{10 + k}|>"', json.dumps(name))
    (path / "tokenizer.json").write_text(text)
    return tokenizer_from_hf_dir(path)


@pytest.fixture(scope="module")
def k25_tokenizer(tmp_path_factory):
    from localmoe.testing import write_checkpoint
    from localmoe.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(write_checkpoint("kimi_k25", tmp_path_factory.mktemp("k25t"), size="tiny"))


def test_openai_parts_become_refs_at_text_offsets():
    loaded = []
    messages = messages_from_openai([{"role": "user", "content": [
        {"type": "text", "text": "first "}, {"type": "image_url", "image_url": {"url": "u1"}},
        {"type": "text", "text": "then"}, {"type": "image_url", "image_url": "u2"}]}],
        load_image=lambda url, where: loaded.append((url, where)) or url.encode())
    (m,) = messages
    assert m.content == "first then" and [(r.offset, r.data) for r in m.images] == [(6, b"u1"), (10, b"u2")]
    assert loaded[0] == ("u1", "messages[0].content[1].image_url")
    with pytest.raises(ChatFormatError, match="only text parts"):  # no loader: images are not read
        messages_from_openai([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}])
    with pytest.raises(ChatFormatError, match="text"):  # only user messages carry images
        messages_from_openai([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
                             load_image=lambda url, where: b"x")


def test_xtml_renders_image_with_its_size_and_one_pad_per_row(k3_media_tokenizer):
    fmt = XtmlFormat(k3_media_tokenizer)
    begin, content, pad, end = (k3_media_tokenizer.token_to_id(t) for t in KIMI_MEDIA)
    text_only = fmt.render([ChatMessage("user", "look here")])
    ids = fmt.render([ChatMessage("user", "look here", images=[sized(PNG_A, 5, tokens=4)])])
    at = ids.index(begin)
    assert ids[at + 1:ids.index(content)] == fmt.pieces.text("image 28x42")
    assert ids[ids.index(content) + 1:ids.index(end)] == [pad] * 4
    decode = k3_media_tokenizer.decode
    assert decode(ids[:at]) == decode(text_only).split("look here")[0] + "look "
    assert decode(ids[ids.index(end) + 1:]).startswith("here<|close|>message")
    with pytest.raises(ChatFormatError, match="not sized"):
        fmt.render([ChatMessage("user", "x", images=[ImageRef.of(PNG_A)])])


def test_xtml_without_media_tokens_says_so(k3_tokenizer):
    with pytest.raises(ChatFormatError, match="no '<\\|media_begin\\|>'"):
        XtmlFormat(k3_tokenizer).render([ChatMessage("user", "x", images=[sized(PNG_A, 0)])])


def test_template_renders_the_kimi_media_placeholder(k25_tokenizer):
    fmt = JinjaFormat(k25_tokenizer)
    ids = fmt.render([ChatMessage("user", "ab", images=[sized(PNG_A, 1, tokens=5)])])
    pad = k25_tokenizer.token_to_id(KIMI_MEDIA[2])
    assert ids.count(pad) == 5
    assert "a<|media_begin|>image<|media_content|>" + "<|media_pad|>" * 5 + "<|media_end|>b" in \
        k25_tokenizer.decode(ids)


def test_harmony_refuses_images(gpt_oss_tokenizer):
    with pytest.raises(ChatFormatError, match="reads text only"):
        HarmonyFormat(gpt_oss_tokenizer).render([ChatMessage("user", "x", images=[sized(PNG_A, 0)])])


def test_sessions_store_each_image_once_and_give_it_back(tmp_path):
    store = SessionStore(tmp_path / "s.db")
    one, two = store.create(), store.create()
    store.append(one, ChatMessage("user", "a and b", images=[ImageRef.of(PNG_A, 0), ImageRef.of(PNG_B, 6)]))
    store.append(one, ChatMessage("assistant", "ok"), ChatMessage("user", "a again", images=[ImageRef.of(PNG_A, 7)]))
    store.append(two, ChatMessage("user", "a", images=[ImageRef.of(PNG_A, 1)]))
    assert store.image_count() == 2
    messages = store.messages(one)
    assert [(r.data, r.offset) for r in messages[0].images] == [(PNG_A, 0), (PNG_B, 6)]
    assert messages[2].images == [ImageRef.of(PNG_A, 7)] and messages[2].images[0].data == PNG_A
    store.delete(one)
    assert store.image_count() == 1  # B is gone with the only session that showed it; A stays for `two`
    store.close()
    copy = tmp_path / "copy.db"
    shutil.copy(tmp_path / "s.db", copy)
    assert SessionStore(copy).messages(two)[0].images[0].data == PNG_A
