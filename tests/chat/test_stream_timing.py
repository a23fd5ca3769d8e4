"""Every chat format streams a token's text at the step that token arrives: only an unfinished UTF-8 character
(and, in the Hermes / Jinja formats, what could start a marker: tests/chat/test_jinja.py) waits for the next
token. After each token of a reply, the text streamed so far on each channel is the text the reply holds so far:
`parse` of the tokens up to there, less a trailing unfinished character."""

import pytest

from localmoe.chat import ChatMessage, HarmonyFormat, XtmlFormat

TEXT = "1. Paris\n2. Lyon é, 🙂 日本 \n\n3. Nice"


@pytest.fixture(params=["harmony", "xtml"])
def fmt(request, gpt_oss_tokenizer, k3_tokenizer):
    return HarmonyFormat(gpt_oss_tokenizer) if request.param == "harmony" else XtmlFormat(k3_tokenizer)


def test_text_streams_at_the_step_it_arrives(fmt):
    ids = fmt.render_reply(ChatMessage("assistant", TEXT, reasoning="think " + TEXT))
    parser, streamed = fmt.stream_parser(), {"content": "", "reasoning": ""}
    for n, token in enumerate(ids, 1):
        for delta in parser.feed(token):
            if delta.channel in streamed:
                streamed[delta.channel] += delta.text
        so_far = fmt.parse(ids[:n])
        for channel, text in streamed.items():
            want = getattr(so_far, channel).rstrip("\ufffd")
            assert text.rstrip() == want.rstrip(), (channel, n, text, want)
    assert streamed["content"].rstrip() == TEXT and streamed["reasoning"].rstrip() == "think " + TEXT
