"""The runtime's completion turn (the one loop `complete`, probe-recall and the paging commands run)
on a scripted model, stepped by an engine worker: stop tokens, stop strings across token boundaries,
max_tokens, context exhaustion, and streaming text equal to the final text."""

import pytest
import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.sampler import SamplingParams
from localmoe.errors import LocalMoEError
from localmoe.runtime.turn import Prepared, run_completion
from localmoe.runtime.worker import EngineWorker, Job
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


def complete(model, tokenizer, prompt, max_tokens=100, stop=()):
    """(streamed texts, TurnResult) of a greedy completion stepped by a worker; raises the job's error."""
    prep = Prepared(prompt=list(prompt), max_tokens=max_tokens, params=GREEDY, stop=list(stop))
    worker, texts, out = EngineWorker(batching="on"), [], {}

    def on_event(kind, payload):
        if kind == "delta":
            texts.append(payload.text)
        else:
            out[kind] = payload

    worker.submit(Job(lambda job: run_completion(tokenizer, model, prep, job.emit, lambda: job.cancelled), on_event))
    while not out:
        worker.step()
    if "error" in out:
        raise out["error"]
    return texts, out["done"]


def _run(tokenizer, text_tokens, **kwargs):
    texts, result = complete(ScriptedModel(text_tokens, tokenizer.vocab_size), tokenizer, [1, 2, 3], **kwargs)
    assert "".join(texts) == result.content
    return texts, result


def test_stops_at_end_of_turn_token_and_hides_it(tokenizer):
    ids = tokenizer.encode("Paris is lovely.", add_special_tokens=False)
    end = tokenizer.token_to_id("<|im_end|>")
    _, result = _run(tokenizer, ids + [end] + ids)
    assert result.content == "Paris is lovely." and result.finish_reason == "stop"
    assert result.completion_tokens == len(ids)


def test_stop_string_split_across_tokens_is_not_emitted(tokenizer):
    ids = tokenizer.encode("alpha beta STOP-HERE gamma", add_special_tokens=False)
    texts, result = _run(tokenizer, ids, stop=["STOP-HERE"], max_tokens=50)
    assert result.content == "alpha beta " and result.finish_reason == "stop"
    assert result.stop_sequence == "STOP-HERE"
    assert all("STOP" not in t for t in texts)


def test_partial_stop_prefix_is_released_when_it_does_not_match(tokenizer):
    ids = tokenizer.encode("one STOP two STOP-HERE", add_special_tokens=False)
    _, result = _run(tokenizer, ids, stop=["STOP-HERE"], max_tokens=50)
    assert result.content == "one STOP two "


def test_max_tokens_gives_length_and_all_text(tokenizer):
    ids = tokenizer.encode("héllo wörld, ça va? 日本語", add_special_tokens=False)
    _, result = _run(tokenizer, ids, max_tokens=len(ids))
    assert result.content == tokenizer.decode(ids) and result.finish_reason == "length"
    assert result.completion_tokens == len(ids)


def test_stream_never_splits_a_character(tokenizer):
    ids = tokenizer.encode("🙂👍🏽 café 日本語テキスト", add_special_tokens=False)
    texts, result = _run(tokenizer, ids, max_tokens=len(ids))
    assert all("\ufffd" not in t for t in texts)
    assert result.content == tokenizer.decode(ids)


def test_context_exhaustion_ends_generation(tokenizer):
    ids = tokenizer.encode("a b c d e f g h i j", add_special_tokens=False)
    model = ScriptedModel(ids, tokenizer.vocab_size, max_context=8)
    _, result = complete(model, tokenizer, [1, 2, 3], max_tokens=100)
    assert result.finish_reason == "length" and result.completion_tokens == 8 - 3
    assert result.content == tokenizer.decode(ids[:8 - 3])


def test_prompt_that_does_not_fit_is_a_clear_error(tokenizer):
    model = ScriptedModel([5], tokenizer.vocab_size, max_context=4)
    with pytest.raises(LocalMoEError, match="context"):
        complete(model, tokenizer, [1, 2, 3, 4, 5])


def test_empty_prompt_is_rejected(tokenizer):
    with pytest.raises(LocalMoEError, match="empty"):
        complete(ScriptedModel([5], 10), tokenizer, [])
