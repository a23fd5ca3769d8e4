"""Prefix cache: a later prompt reuses a finished sequence's cache and gets, bit for bit, the logits of a
fresh run (reuse stops at a prefill-chunk boundary within what the earlier sequence prefilled)."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.generate import Decoder
from localmoe.engine.prefix_cache import PrefixCache, common_prefix
from localmoe.engine.sampler import SamplingParams
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import random_tokens

GREEDY = SamplingParams(temperature=0.0)
CHUNK = 16  # prefill chunk (the reuse grain), small so that short prompts span several


@pytest.fixture(scope="module", params=["gpt_oss", "kimi_linear"])
def model(request, tmp_path_factory):
    """gpt-oss: paged K/V (trims anywhere); Kimi-Linear: KDA states (reusable up to a prompt's end)."""
    path = write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny", seed=0)
    return load_model(path, EngineConfig(dtype="float32", threads=1), progress=False).model


def run(model, prompt: list[int], steps: int, prefix_cache=None, anchor=None,
        dec: Decoder | None = None) -> tuple[list[int], torch.Tensor, Decoder]:
    """Greedy tokens and the logits before each [steps, V] (of `dec`, made here where not given)."""
    dec = dec or Decoder(model, prompt, GREEDY, prefill_chunk=CHUNK, prefix_cache=prefix_cache, anchor=anchor)
    tokens, logits = [], []
    while len(tokens) < steps:
        out = dec.logits()
        if out is None:
            continue
        logits.append(out[0])
        tokens.append(dec.sample(out))
        dec.feed([tokens[-1]])
    dec.release()
    return tokens, torch.stack(logits), dec


def test_the_next_turn_reuses_the_previous_sequence(model):
    cache = PrefixCache()
    first = random_tokens(40, 1, model.spec.vocab_size)[0].tolist()
    reply, _, _ = run(model, first, 6, cache)
    assert cache.misses == 1 and len(cache.entries) == 1
    # the next turn: the previous prompt, most of the reply as the template re-renders it, then new text
    second = first + reply[:4] + random_tokens(12, 2, model.spec.vocab_size)[0].tolist()
    got_tokens, got, dec = run(model, second, 8, cache)
    want_tokens, want, fresh = run(model, second, 8)
    # shared: 44 tokens, of which the first turn prefilled 40 (its reply ran token by token): the last
    # chunk boundary within them is 32 (a KDA state comes back to its snapshot there)
    assert dec.reused == 32 and cache.hits == 1 and cache.reused_tokens == 32
    assert fresh.reused == 0 and dec.forwards == fresh.forwards - 2  # two prompt chunks fewer
    assert torch.equal(got, want) and got_tokens == want_tokens


def test_a_prompt_equal_to_a_cached_one_still_runs_its_last_token(model):
    """The last prompt token always runs (its logits start the generation): a 20-token prompt reuses 16."""
    cache = PrefixCache()
    prompt = random_tokens(20, 3, model.spec.vocab_size)[0].tolist()
    run(model, prompt, 1, cache)  # one step: the cache holds the prompt only (the sampled token was not run)
    _, got, dec = run(model, prompt, 3, cache)
    _, want, _ = run(model, prompt, 3)
    assert dec.reused == 16
    assert torch.equal(got, want)


def test_entries_are_bounded_and_unrelated_prompts_miss(model):
    cache = PrefixCache(max_entries=2)
    prompts = [random_tokens(20, seed, model.spec.vocab_size)[0].tolist() for seed in (4, 5, 6)]
    for p in prompts:
        run(model, p, 2, cache)
    assert [e.tokens[:20] for e in cache.entries] == prompts[1:]  # at most two: the oldest went
    first_tokens = {e.tokens[0] for e in cache.entries}
    start = next(t for t in range(model.spec.vocab_size) if t not in first_tokens)
    other = [start] + prompts[1][1:]  # shares nothing from its first token on
    assert all(common_prefix(other, e.tokens) == 0 for e in cache.entries)
    misses = cache.misses
    _, _, dec = run(model, other, 1, cache)
    assert dec.reused == 0 and cache.misses == misses + 1
    tiny = PrefixCache(max_bytes=1)
    run(model, prompts[0], 1, tiny)
    assert tiny.entries == []  # larger than the budget: not kept


def test_a_header_is_copied_to_every_taker_and_the_entry_stays(model, monkeypatch):
    """Prompts that reuse no more than an entry's header (up to its anchor) each take a copy of it: the entry stays
    as it was (offset, bytes, the logits the next taker gets), each copy holds only the blocks that cover the header
    and is the taker's alone, and every taker's logits are those of a fresh run."""
    import localmoe.engine.cache as cache_module

    monkeypatch.setattr(cache_module, "BLOCK_TOKENS", 8)  # several blocks: a copy takes the header's 3 of 5
    cache, vocab = PrefixCache(), model.spec.vocab_size
    header = random_tokens(20, 7, vocab)[0].tolist()  # anchor 20: chunks end at 16 and 20
    run(model, header + random_tokens(14, 8, vocab)[0].tolist(), 2, cache, anchor=20)
    (entry,) = cache.entries
    held, nbytes = entry.cache.offset, entry.cache.nbytes()
    prompts = [header + random_tokens(9, seed, vocab)[0].tolist() for seed in (9, 10, 11)]
    takers = [Decoder(model, p, GREEDY, prefill_chunk=CHUNK, prefix_cache=cache, anchor=20) for p in prompts]
    assert [d.reused for d in takers] == [20, 20, 20] and cache.hits == 3 and cache.entries == [entry]
    assert len({id(d.cache) for d in takers} | {id(entry.cache)}) == 4
    assert all(d.cache.offset == 20 and d.cache.nbytes() < nbytes for d in takers)
    for prompt, dec in zip(prompts, takers):
        got_tokens, got, _ = run(model, prompt, 5, dec=dec)
        want_tokens, want, _ = run(model, prompt, 5, anchor=20)  # fresh: the same chunks
        assert torch.equal(got, want) and got_tokens == want_tokens
    assert entry.cache.offset == held and entry.cache.nbytes() == nbytes  # the takers wrote into their copies
    _, got, dec = run(model, prompts[0], 5, cache, anchor=20)  # and the entry still gives the header
    assert dec.reused == 20 and torch.equal(got, run(model, prompts[0], 5, anchor=20)[1])


def test_a_prompt_that_prefills_a_header_leaves_it_for_the_others(model):
    """A sequence whose prompt passes an anchor the cache holds no header for leaves a copy of the header as soon as
    its prompt passes it (not at its end): a prompt that starts then (a burst's next, `_look_again`) reuses it."""
    cache, vocab = PrefixCache(), model.spec.vocab_size
    header = random_tokens(20, 12, vocab)[0].tolist()
    prompts = [header + random_tokens(9, seed, vocab)[0].tolist() for seed in (13, 14)]
    first = Decoder(model, prompts[0], GREEDY, prefill_chunk=CHUNK, prefix_cache=cache, anchor=20)
    second = Decoder(model, prompts[1], GREEDY, prefill_chunk=CHUNK, prefix_cache=cache, anchor=20)
    assert first.header == second.header == tuple(header) and first.untouched and second.untouched
    while len(first.in_cache) < 20:
        assert cache.entries == [] and first.logits() is None
    (entry,) = cache.entries  # the header, while `first` is still prefilling
    assert entry.tokens == header and entry.anchor == entry.prefilled == 20 and first.header is None
    got_tokens, got, _ = run(model, prompts[1], 4, dec=second)
    assert second.reused == 20 and cache.misses == 1 and cache.hits == 1  # its first look missed: counted once
    want_tokens, want, _ = run(model, prompts[1], 4, anchor=20)
    assert torch.equal(got, want) and got_tokens == want_tokens


def test_an_entry_that_a_newer_one_covers_goes(model):
    """Two requests with one header and short tails can each give a later prompt the header only (their own
    positions past it end no chunk): the second's entry covers the first's, which goes; an entry that gives more
    (a longer prompt: a chunk end past the header) or other tokens stays, and covers a header-only one where its cache
    comes back to the header (K/V: anywhere; a KDA state: only to its one snapshot, at 36)."""
    cache, vocab = PrefixCache(), model.spec.vocab_size
    header = random_tokens(20, 15, vocab)[0].tolist()
    for seed in (16, 17):
        run(model, header + random_tokens(9, seed, vocab)[0].tolist(), 2, cache, anchor=20)
    (entry,) = cache.entries
    assert entry.reach == 20 and entry.tokens[20:29] == random_tokens(9, 17, vocab)[0].tolist()
    run(model, header + random_tokens(30, 18, vocab)[0].tolist(), 2, cache, anchor=20)  # a chunk ends at 36
    run(model, random_tokens(20, 19, vocab)[0].tolist(), 2, cache, anchor=10)  # another header
    stateful = any(hasattr(layer, "snapshot") for layer in entry.cache.layers)
    assert [e.reach for e in cache.entries] == ([20, 36, 10] if stateful else [36, 10])
    run(model, header + random_tokens(9, 20, vocab)[0].tolist(), 2, cache, anchor=20)
    assert sorted(e.reach for e in cache.entries) == [10, 20, 36]  # a header-only entry went (K/V: none was left)
