"""stream_generate / generate on a scripted model: stop tokens, stop strings across token
boundaries, max_tokens, context exhaustion, and streaming text equal to the final text."""

import pytest
import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.generate import generate, generate_step, stream_generate
from localmoe.engine.sampler import SamplingParams
from localmoe.errors import LocalMoEError
from localmoe.tokenizer import tokenizer_from_gguf

GREEDY = SamplingParams(temperature=0)


class ScriptedModel:
    """A CausalLM whose greedy continuation is a fixed token script (then the last token repeats)."""

    def __init__(self, script: list[int], vocab: int, max_context: int = 256):
        self.script, self.vocab, self.max_context = script, vocab, max_context
        self.calls = 0

    def new_cache(self, batch=1, max_len=None):
        return ModelCache([], batch, max_len or self.max_context)

    def forward(self, tokens, cache, mask=None, all_logits=False):
        cache.reserve(tokens.shape[1])
        cache.advance(tokens.shape[1])
        step = min(self.calls, len(self.script) - 1)
        self.calls += 1
        logits = torch.zeros(tokens.shape[0], 1, self.vocab)
        logits[:, :, self.script[step]] = 1.0
        return logits


@pytest.fixture(scope="module")
def tokenizer(smollm2_gguf):
    return tokenizer_from_gguf(smollm2_gguf)


def _run(tokenizer, text_tokens, **kwargs):
    model = ScriptedModel(text_tokens, tokenizer.vocab_size)
    chunks = list(stream_generate(model, tokenizer, [1, 2, 3], GREEDY, **kwargs))
    return chunks, "".join(c.text for c in chunks)


def test_stops_at_end_of_turn_token_and_hides_it(tokenizer):
    ids = tokenizer.encode("Paris is lovely.", add_special_tokens=False)
    end = tokenizer.token_to_id("<|im_end|>")
    chunks, text = _run(tokenizer, ids + [end] + ids)
    assert text == "Paris is lovely." and chunks[-1].finish_reason == "stop"
    assert chunks[-1].tokens == ids and chunks[-1].stats.generated_tokens == len(ids) + 1


def test_stop_string_split_across_tokens_is_not_emitted(tokenizer):
    ids = tokenizer.encode("alpha beta STOP-HERE gamma", add_special_tokens=False)
    chunks, text = _run(tokenizer, ids, stop=["STOP-HERE"], max_tokens=50)
    assert text == "alpha beta " and chunks[-1].finish_reason == "stop"
    assert all("STOP" not in c.text for c in chunks)


def test_partial_stop_prefix_is_released_when_it_does_not_match(tokenizer):
    ids = tokenizer.encode("one STOP two STOP-HERE", add_special_tokens=False)
    _, text = _run(tokenizer, ids, stop=["STOP-HERE"], max_tokens=50)
    assert text == "one STOP two "


def test_max_tokens_gives_length_and_all_text(tokenizer):
    ids = tokenizer.encode("héllo wörld, ça va? 日本語", add_special_tokens=False)
    chunks, text = _run(tokenizer, ids, max_tokens=len(ids))
    assert text == tokenizer.decode(ids) and chunks[-1].finish_reason == "length"
    assert len(chunks[-1].tokens) == len(ids)


def test_stream_never_splits_a_character(tokenizer):
    ids = tokenizer.encode("🙂👍🏽 café 日本語テキスト", add_special_tokens=False)
    chunks, text = _run(tokenizer, ids, max_tokens=len(ids))
    assert all("\ufffd" not in c.text for c in chunks)
    assert text == tokenizer.decode(ids)


def test_generate_collects_the_stream(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris.", add_special_tokens=False)
    model = ScriptedModel(ids + [tokenizer.token_to_id("<|im_end|>")], tokenizer.vocab_size)
    result = generate(model, tokenizer, [1, 2], GREEDY, max_tokens=100)
    assert result.text == "The capital of France is Paris." and result.tokens == ids
    assert result.finish_reason == "stop"


def test_context_exhaustion_ends_generation(tokenizer):
    ids = tokenizer.encode("a b c d e f g h i j", add_special_tokens=False)
    model = ScriptedModel(ids, tokenizer.vocab_size, max_context=8)
    chunks = list(stream_generate(model, tokenizer, [1, 2, 3], GREEDY, max_tokens=100))
    assert chunks[-1].finish_reason == "length" and len(chunks[-1].tokens) == 8 - 3 + 1


def test_prompt_that_does_not_fit_is_a_clear_error(tokenizer):
    model = ScriptedModel([5], tokenizer.vocab_size, max_context=4)
    with pytest.raises(LocalMoEError, match="context"):
        next(generate_step(model, [1, 2, 3, 4, 5], GREEDY))


def test_empty_prompt_is_rejected(tokenizer):
    with pytest.raises(LocalMoEError, match="empty"):
        next(generate_step(ScriptedModel([5], 10), [], GREEDY))
