"""Real tokenizers for the chat-format tests: generated K3 and gpt-oss checkpoints, SmolLM2's GGUF."""

import pytest

from localmoe.chat.format import ParsedReply


@pytest.fixture(scope="session")
def k3_tokenizer(tmp_path_factory):
    from localmoe.testing import write_checkpoint
    from localmoe.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(write_checkpoint("kimi_k3", tmp_path_factory.mktemp("k3"), size="tiny"))


@pytest.fixture(scope="session")
def gpt_oss_tokenizer(tmp_path_factory):
    from localmoe.testing import write_checkpoint
    from localmoe.tokenizer import tokenizer_from_hf_dir

    return tokenizer_from_hf_dir(write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), size="tiny"))


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_gguf):
    from localmoe.tokenizer import tokenizer_from_gguf

    return tokenizer_from_gguf(smollm2_gguf)


def _stream(fmt, ids):
    """Feed `ids` one at a time, then flush: (deltas, finish()), after checking the deltas add up to the reply (each
    channel's stream may end in whitespace the reply strips: whitespace after text streams as it comes)."""
    parser = fmt.stream_parser()
    deltas = [d for token_id in ids for d in parser.feed(token_id)]
    deltas += parser.flush()
    assert parser.flush() == []
    reply = parser.finish()
    assert isinstance(reply, ParsedReply)
    for channel in ("reasoning", "content"):
        streamed = "".join(d.text for d in deltas if d.channel == channel)
        assert streamed.rstrip() == getattr(reply, channel) and not streamed[:1].isspace()
    assert [d.tool_call for d in deltas if d.channel == "tool"] == reply.tool_calls
    assert all(d.channel in ("reasoning", "content", "tool") for d in deltas)
    return deltas, reply


@pytest.fixture
def stream():
    """stream(fmt, ids) -> (deltas, reply): a streamed parse whose deltas are checked against its reply."""
    return _stream
