"""Speculative decoding is lossless: greedy output with speculation equals greedy output without, token
for token, on every runnable tiny family (dense Llama, gpt-oss: sliding windows and sinks, Kimi-Linear,
Kimi K3: MLA + KDA + MoE with attention residuals, Qwen3-Next: Gated DeltaNet), with prompt lookup and
with draft models (the target itself: every draft kept; another model: most rejected), with the paged
caches shrunk to 16-token blocks so rollbacks cross blocks. "Without" is the same row kernels a
speculating sequence takes (decode_together, batched mode)."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.generate import Decoder, decode_together
from localmoe.engine.sampler import SamplingParams
from localmoe.engine.spec.draft_model import DraftModel
from localmoe.engine.spec.drafters import Draft, PromptLookup
from localmoe.engine.spec.speculator import BUCKETS, RETIRE_AFTER, Speculator, bucket
from localmoe.testing.parity import kv_cache_dtype, random_tokens

GREEDY = SamplingParams(temperature=0.0)
STEPS = 40


pytestmark = pytest.mark.usefixtures("small_blocks")  # tests/engine/conftest.py, as `model`


def prompt_for(model) -> list[int]:
    """A prompt that repeats itself (prompt lookup finds matches), 37 tokens."""
    part = random_tokens(12, 3, model.spec.vocab_size)[0].tolist()
    return part + [1, 2] + part + [5] + part[:10]


class NoDraft:
    name = "none"

    def propose(self, history, k, params, generator):
        return Draft([])


class Verified(PromptLookup):
    """Prompt lookup's match classes, but tried by verifies, not in the shadow (as a drafter whose drafts are not
    a function of the history alone is: a sampled one)."""

    deterministic = False


def yardstick(spec) -> None:
    """t(1) measured: two plain steps (a fresh model's first drops out: its kernels' first use, costs.py)."""
    spec.observe(0, 0, 1, 1.0)
    spec.observe(0, 0, 1, 1.0)


def run(model, prompt, steps=STEPS, speculator=None, params=GREEDY, logits=None) -> tuple[list[int], Decoder]:
    """Generated tokens; without a speculator each decode step is one row of the batched step: decode_together,
    or, for a model with a residual scheme (K3's attention residuals: its plain `logits()` takes its own
    decode step), a speculator that never drafts. `logits`: a list that gets each token's logits."""
    if speculator is None and model.residuals is not None:
        speculator = Speculator(NoDraft(), k=1, adaptive=False)
    dec = Decoder(model, prompt, params, speculator=speculator)
    out: list[int] = []
    while len(out) < steps:
        row = decode_together([dec])[0] if dec.decoding and speculator is None else dec.logits()
        if row is None:
            continue
        if logits is not None:
            logits.append(row.reshape(-1).clone())
        token = dec.sample(row)
        out.append(token)
        dec.feed([token])
    return out, dec


def test_prompt_lookup_greedy_equals_plain(model):
    prompt = prompt_for(model)
    want, _ = run(model, prompt)
    spec = Speculator(PromptLookup(), k=4, adaptive=False)
    got, dec = run(model, prompt, speculator=spec)
    assert got == want
    assert spec.stats.drafted > 0, "prompt lookup never drafted: the test would not exercise a verify"
    # the last token is pending, unless it was a kept draft (in the cache, the target's token still `ready`);
    # kept drafts not handed out yet are in the cache too
    assert dec.cache.offset == len(prompt) + STEPS - (0 if dec.ready else 1) + len(dec.ahead)


def test_draft_model_greedy_equals_plain(model, tmp_path):
    prompt = prompt_for(model)
    want, _ = run(model, prompt)
    itself = Speculator(DraftModel(model, model.spec.vocab_size), k=3, adaptive=False)
    got, _ = run(model, prompt, speculator=itself)
    assert got == want
    # a draft agreeing with the target is kept (the draft runs the model's own decode step: its rounding
    # may differ at near-ties, so not every one)
    assert itself.stats.acceptance > 0.8, itself.stats
    assert itself.stats.tokens_per_step > 2.5, itself.stats


class Wrong:
    """Drafts the last token again k times: mostly rejected, so every verify writes rows that leave the cache."""
    name = "wrong"
    deterministic = False

    def propose(self, history, k, params, generator):
        return Draft([history[-1]] * k)


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_greedy_equals_plain_over_a_lossy_cache_after_rejected_drafts(model, dtype):
    """bf16 / fp8 caches keep their newest positions exact in a ring (slot = position % 32): a verify's drafts take
    the slots of the positions 32 before them; once they are rejected, those positions must read exact again, as
    they do in a plain run. The prompt (37 tokens) is past the ring from the first step."""
    prompt = prompt_for(model)
    with kv_cache_dtype(model, dtype):
        want_logits: list = []
        want, _ = run(model, prompt, logits=want_logits)
        for drafter in (Wrong(), Verified()):
            spec = Speculator(drafter, k=4, adaptive=False)
            got_logits: list = []
            got, _ = run(model, prompt, speculator=spec, logits=got_logits)
            assert got == want, drafter.name
            assert spec.stats.drafted > spec.stats.accepted, "no draft was rejected: nothing rolled back"
            for step, (a, b) in enumerate(zip(got_logits, want_logits)):  # the same bits, not only the argmax
                assert torch.equal(a, b), f"{drafter.name}: step {step}, max |diff| {(a - b).abs().max():.3e}"


def test_injected_token_drops_kept_drafts(model):
    """A caller that feeds another token (a thinking budget's marker) while kept drafts are still ahead:
    the cache drops them (delta-rule states restored), and what follows equals a plain run fed the same."""
    prompt = prompt_for(model)
    spec = Speculator(DraftModel(model, model.spec.vocab_size), k=4, adaptive=False)
    dec = Decoder(model, prompt, GREEDY, speculator=spec)
    out: list[int] = []
    while not dec.ahead:  # until a step kept at least one draft
        logits = dec.logits()
        if logits is None:
            continue
        out.append(dec.sample(logits))
        dec.feed([out[-1]])
    inject = [7, 8]
    dec.feed(inject)
    assert not dec.ahead and not dec.ready
    tail = []
    for _ in range(8):
        logits = dec.logits()
        tail.append(dec.sample(logits))
        dec.feed([tail[-1]])
    plain = Decoder(model, prompt, GREEDY, speculator=None if model.residuals is None else
                    Speculator(NoDraft(), k=1, adaptive=False))
    for t in out:  # the same history, teacher-forced through the plain rows path
        logits = plain.logits()
        while logits is None:
            logits = plain.logits()
        plain.feed([t])
    plain.feed(inject)
    want = []
    for _ in range(8):
        logits = decode_together([plain])[0] if plain.decoding and plain.speculator is None else plain.logits()
        want.append(plain.sample(logits))
        plain.feed([want[-1]])
    assert tail == want


def _greedy_steps(model, prompt, fused: bool, speculator=None, n: int = 8) -> list[int]:
    """n greedy tokens, one decode_together step per token (a speculating sequence's kept tokens come from logits())."""
    dec = Decoder(model, prompt, GREEDY, speculator=speculator)
    out = []
    while len(out) < n:
        logits = decode_together([dec], fused=fused)[0] if dec.decoding and not dec.ready else dec.logits()
        if logits is not None:
            out.append(dec.sample(logits))
            dec.feed([out[-1]])
    return out


class EveryOther(Wrong):
    """Drafts (mostly wrongly) at every other step and declines between: a verify, then a plain step."""

    def propose(self, history, k, params, generator):
        return super().propose(history, k, params, generator) if len(history) % 2 else Draft([])


def test_fused_plain_steps_between_verifies_equal_plain(model):
    """A speculating sequence's plain step (the speculator declines) may be the model's fused one-token step, which
    updates a hybrid model's delta-rule states in place (decode_plan.py `_hybrid_run`) while the verify before it
    still records. Safe because the only state it changes is the one a recording `advance` held (not copied) at
    the current offset, which the step's `_ran` then drops with the rest of the recording (generate.py); snapshots
    taken outside a recording are copies. Verifies and fused plain steps interleaved give the plain fused run's
    tokens, the fused step does run right after verifies, and each such step ends the recording."""
    plan = model.decode_plan()
    if plan is None or plan._run is None:
        pytest.skip("no fused hybrid step for this family")
    prompt = prompt_for(model)
    want = _greedy_steps(model, prompt, fused=True, n=24)
    spec = Speculator(EveryOther(), k=3, adaptive=False)
    dec = Decoder(model, prompt, GREEDY, speculator=spec)
    delta = [layer for layer in dec.cache.layers if hasattr(layer, "recording")]
    run_fused, after_verify = plan._run, []

    def counted(plan_, tokens, cache):
        after_verify.append(any(layer.recording for layer in delta))
        return run_fused(plan_, tokens, cache)

    plan._run = counted
    try:
        got = []
        while len(got) < 24:
            calls = len(after_verify)
            logits = decode_together([dec], fused=True)[0] if dec.decoding and not dec.ready else dec.logits()
            if len(after_verify) > calls and after_verify[-1]:  # a fused step on a recorded state: it ended it
                assert not any(layer.recording for layer in delta)
            if logits is not None:
                got.append(dec.sample(logits))
                dec.feed([got[-1]])
    finally:
        plan._run = run_fused
    assert got == want
    assert delta and spec.stats.drafted > 0 and any(after_verify), (spec.stats, after_verify)


def test_prompt_lookup_drafts_the_continuation():
    lookup = PromptLookup()
    history = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert lookup.propose(history, 3).tokens == [4, 5, 9]
    history += [4, 5, 6, 1, 2]  # [6, 1, 2] was not seen before; the latest [1, 2] is followed by 3, 4
    assert lookup.propose(history, 2).tokens == [3, 4]
    assert lookup.propose([1, 2, 3], 4).tokens == []
    assert lookup.propose([7, 8, 7], 4).tokens == [8, 7]


def test_prompt_lookup_drafts_after_the_longest_match():
    """Of the earlier occurrences of the last token, the one preceded by the longest match wins (not the latest)."""
    lookup = PromptLookup()
    history = [5, 6, 7, 1, 2, 3, 8, 8, 9, 2, 3, 4, 4, 6, 7, 1, 2]  # [6, 7, 1, 2] matches at 1..4; [2] is latest at 9
    draft = lookup.propose(history, 2)
    assert draft.tokens == [3, 8] and draft.source == 5 and draft.match == 4
    assert PromptLookup(min_ngram=2).propose([1, 2, 3, 9, 3], 2).tokens == []  # one token matched: below min_ngram


def test_prompt_lookup_finds_the_longest_earlier_match_as_tokens_come():
    """The suffix automaton, fed a token at a time (and once with a rewind), knows after each the longest suffix of
    the sequence that occurred before, and a place where it did: against a brute-force search, random sequences over
    small alphabets (many repeats, states split)."""
    import random

    rng = random.Random(0)
    for trial in range(120):
        seq = [rng.randrange(rng.choice([2, 3, 7])) for _ in range(rng.randrange(2, 120))]
        lookup = PromptLookup()
        for n in range(2, len(seq) + 1):
            history = seq[:n]
            if trial % 10 == 0 and n == len(seq) // 2:
                lookup._update(history[:-1] + [99])  # a rewind: the index starts afresh
            draft = lookup.propose(history, 3)
            best = max(next(length for length in range(e + 2) if length > e or
                            history[e - length] != history[n - 1 - length]) for e in range(n - 1))
            c, length = lookup._found
            assert length == best
            if best:
                end = lookup._at[c]
                assert end < n - 1 and history[end - best + 1:end + 1] == history[n - best:]
                assert draft.tokens == history[end + 1:end + 4] and draft.match == min(best, 32)
            else:
                assert draft.tokens == []
            # the next token extends a match by one key at most: no call is needed while none of `least` can be
            assert lookup.hopeless(n + 1, best + 2) and not lookup.hopeless(n + 1, best + 1)
            assert not lookup.hopeless(n, best + 2)  # the same length: not a history grown at its end


def test_prompt_lookup_follows_a_quote_that_joins_lines(smollm2_gguf):
    """A hard-wrapped document quoted as one line: the match ignores whitespace and the draft is the source's
    text respaced as the quote spaces it, tokenized afresh (what the model would write next)."""
    from localmoe.tokenizer import tokenizer_from_gguf

    tok = tokenizer_from_gguf(smollm2_gguf)
    source = "one read fetches the gate,\nup and down\nmatrices of an expert together.\n\nQuote it: "
    quote = "one read fetches the gate, up and"
    history = tok.encode(source + quote, add_special_tokens=False)
    whole = tok.encode(source + quote + " down matrices of an expert", add_special_tokens=False)
    assert whole[:len(history)] == history
    want = whole[len(history):][:4]
    exact = PromptLookup().propose(history, 4).tokens
    near = PromptLookup(tokenizer=tok).propose(history, 4)
    assert near.tokens == want and near.match >= 6 and exact != want
    # spaced as the source: its own tokens
    same = tok.encode(source + "one read fetches the gate,\nup", add_special_tokens=False)
    assert PromptLookup(tokenizer=tok).propose(same, 3).tokens == tok.encode(source + "one read fetches the gate,\nup and down\n",
                                                                           add_special_tokens=False)[len(same):][:3]


@pytest.mark.parametrize("fused", [True, False])
def test_steps_where_every_speculator_declines_are_the_plain_step(model, monkeypatch, fused):
    """A step where no sequence drafts is the plain step (fused or batched rows, as plain sequences take): the
    plain run's tokens, no acceptance, no verify; only its time is observed. Where plain steps are fused, it is
    the model's own step: no forward_rows call at all."""
    from localmoe.engine.spec import verify

    prompt = prompt_for(model)
    want = _greedy_steps(model, prompt, fused=fused)

    def no_verify(*args, **kwargs):
        raise AssertionError("a step without a draft went through the acceptance")

    def no_rows(*args, **kwargs):
        raise AssertionError("a fused step without a draft ran the row kernels")

    monkeypatch.setattr(verify, "_accept", no_verify)
    if fused:
        monkeypatch.setattr(verify, "forward_rows", no_rows)
    spec = Speculator(NoDraft(), k=1, adaptive=False)
    got = _greedy_steps(model, prompt, fused=fused, speculator=spec)
    assert got == want and spec.stats.steps == 7 and spec.costs.t1() is not None


def test_a_declining_speculator_prices_its_classes_once(monkeypatch):
    """Plain step after plain step, the classes' best k are not priced again (their inputs did not change) until
    a verify runs or t(1) moves by more than REPRICE; prompt lookup is told the shortest match worth a draft and
    builds none after a shorter one."""
    from localmoe.engine.spec.costs import PLAIN
    from localmoe.engine.spec.speculator import REPRICE

    spec = Speculator(PromptLookup(), k=4)
    yardstick(spec)
    for _ in range(10):
        spec.observe(4, 4, 5, 1.5, bucket(Draft([1], match=12)))
        spec.observe(4, 0, 5, 1.5, bucket(Draft([1], match=1)))
    spec.observe(0, 0, 1, 1.0)
    priced = []
    best = spec._best
    monkeypatch.setattr(spec, "_best", lambda a, costs=None: priced.append(a) or best(a, costs))
    spec.choose_k()
    assert len(priced) == BUCKETS
    least = spec.least_match()
    assert least > 1 and spec.fit(Draft([1, 2], match=1)).tokens == []
    for i in range(40):  # plain steps, t(1) within REPRICE
        spec.choose_k()
        spec.least_match()
        spec.fit(Draft([]))
        spec.observe(0, 0, 1, 1.0 + REPRICE / 2 * (i % 2))
    assert len(priced) == BUCKETS
    for _ in range(PLAIN):  # slower plain steps move t(1) past REPRICE: priced again
        spec.observe(0, 0, 1, 1.0 + 2 * REPRICE)
    spec.choose_k()
    assert len(priced) == 2 * BUCKETS
    spec.observe(4, 4, 5, 1.5, bucket(Draft([1], match=12)))  # a verify: priced again
    spec.choose_k()
    assert len(priced) == 3 * BUCKETS
    history = [7, 1, 2, 3, 9, 5, 1, 2, 3]  # the last 3 tokens match 3 earlier ones
    assert PromptLookup().propose(history, 2, least=4).tokens == []
    assert PromptLookup().propose(history, 2, least=2).tokens == [9, 5]


def test_k_follows_measured_acceptance_and_step_cost():
    """Drafts kept and cheap extra rows: the most drafts; drafts rejected: none, and after RETIRE_AFTER such
    steps a drafter that costs something at k = 0 stops speculating (back to the engine's own decode step),
    while prompt lookup (free) goes on declining."""
    good = Speculator(PromptLookup(), k=4)
    for _ in range(20):
        good.observe(4, 4, 5, 1.4)  # 5 rows cost 1.4x one row
        good.observe(0, 0, 1, 1.0)
    assert good.choose_k() == 4 and not good.retired
    costly = Speculator(PromptLookup(), k=4)
    for _ in range(20):
        costly.observe(4, 2, 5, 4.0)  # half the drafts kept, but 5 rows cost 4x one (experts read per row)
        costly.observe(0, 0, 1, 1.0)
    assert costly.choose_k() in (0, 1)
    bad = Speculator(NoDraft(), k=4)
    for _ in range(20):
        bad.observe(4, 0, 5, 1.4)
        bad.observe(0, 0, 1, 1.0)
    assert bad.choose_k() == 0
    for _ in range(RETIRE_AFTER):
        bad.choose_k()
    assert bad.retired
    lookup = Speculator(PromptLookup(), k=4)  # drafts after 1-token matches rejected: cut, never retired
    for _ in range(20):
        lookup.observe(4, 0, 5, 1.4, bucket(Draft([1], match=1)))
        lookup.observe(0, 0, 1, 1.0)
    tried = 0
    for _ in range(RETIRE_AFTER):
        lookup.choose_k()
        tried += len(lookup.fit(Draft([1, 2, 3, 4], match=1)).tokens)
    assert tried <= 1 and not lookup.retired  # one try (PROBE) at most


def test_k_follows_the_acceptance_of_the_drafts_confidence_class():
    """Long matches kept, single-token matches rejected: a draft copied after a long match is verified whole,
    one after a single-token match is dropped (a plain step), and the sequence keeps speculating."""
    spec = Speculator(PromptLookup(), k=4)
    for _ in range(10):
        spec.choose_k()
        spec.observe(4, 4, 5, 2.0, bucket(Draft([1, 2, 3, 4], match=12)))
        spec.choose_k()
        spec.observe(4, 0, 5, 2.0, bucket(Draft([1, 2, 3, 4], match=1)))
        spec.choose_k()
        spec.observe(0, 0, 1, 1.0)
    assert spec.choose_k() == 4
    assert spec.fit(Draft([1, 2, 3, 4], match=9)).tokens == [1, 2, 3, 4]
    assert spec.fit(Draft([1, 2, 3, 4], match=1)).tokens == []
    for _ in range(RETIRE_AFTER):
        spec.choose_k()
    assert not spec.retired


def test_a_class_whose_drafts_are_right_or_wrong_together_is_priced_by_its_first_draft():
    """A single-token match is mostly either a quote's start (its drafts all kept) or a common word (none kept): a
    class tried 4 drafts at a time, all kept in one try of four and none in the others, yields 1 + 4 / 4 = 2 tokens
    per 5-row step, less than the step costs at 0.27 plain steps a row (5 rows: 2.08), and one draft a step fewer
    than its 2 rows cost: not verified. One number a (kept / (kept + failures), ~0.4 here) priced one draft at
    1.4 tokens for 1.27 plain steps and verified it. A class whose drafts are all kept is verified whole."""
    from localmoe.engine.spec.costs import TRUSTED, StepCosts

    table = StepCosts(rows_plain=True)
    for _ in range(20):
        table.plain(1.0)
    for r in range(2, 6):
        for _ in range(TRUSTED + 1):
            table.verify(r, 1 + 0.27 * (r - 1))
    spec = Speculator(PromptLookup(), k=4)
    spec.costs = table
    for _ in range(5):
        for kept in (4, 0, 0, 0):
            spec.settle_shadow(bucket(Draft([1], match=1)), kept, 4)
        spec.settle_shadow(bucket(Draft([1], match=9)), 4, 4)
    p, c = spec.bucket_acceptance(1)
    assert 0.1 < p < 0.3 and c > 0.8  # (decayed counts, recent tries weigh most; the prior 0.15 at weight 2)
    assert spec._priced_classes()[1][0] == 0 and spec._priced_classes()[4][0] == 4


def test_a_drafters_own_time_is_priced_per_draft():
    """Drafts always kept and 5 rows at 1.4x one, but each draft costs a plain step to make (a slow draft
    model): no k pays. The same steps with drafts made for free: the most drafts."""
    for drafting, want in ((1.0, 0), (0.0, 4)):
        spec = Speculator(Verified(), k=4)
        for _ in range(10):
            spec.observe(4, 4, 5, 1.4, 0, 4 * drafting)
            spec.observe(0, 0, 1, 1.0)
        assert spec.choose_k() == want and spec.draft_seconds == drafting


def test_the_first_verify_is_one_that_pays_even_at_a_pessimistic_cost():
    """The first steps are plain (the yardstick; on a fresh model the first pays its kernels' first use). Before
    any verify is measured its rows are priced at two plain steps and more: only a draft after a long match (mostly
    kept) is verified, others are plain steps; a row count's first time on the model (its kernels' first use) is
    not a sample, for plain steps and verifies alike (one rule, in the model's table: costs.py)."""
    spec = Speculator(PromptLookup(), k=4)
    assert spec.choose_k() == 0
    spec.observe(0, 0, 1, 3.0)  # first use
    assert spec.choose_k() == 0 and spec.times_plain
    spec.observe(0, 0, 1, 1.0)
    assert spec.costs.t1() == 1.0
    assert spec.choose_k() == 4  # some class may pay: the lookup runs
    assert spec.fit(Draft([1, 2, 3, 4], match=1)).tokens == []
    assert spec.fit(Draft([1, 2, 3, 4], match=3)).tokens == []
    assert spec.fit(Draft([1, 2, 3, 4], match=12)).tokens == [1, 2, 3, 4]
    spec.observe(4, 4, 5, 5.0, bucket(Draft([1], match=12)))  # first use
    assert spec.costs.measured(5) == 0
    spec.observe(4, 4, 5, 1.5, bucket(Draft([1], match=12)))
    assert list(spec.costs._samples[5]) == [1.5]
    other = Speculator(PromptLookup(), k=4)  # a second sequence on the same model: nothing dropped again
    other.costs = spec.costs
    assert other.choose_k() == 4
    other.observe(2, 1, 3, 1.3, bucket(Draft([1], match=12)))
    other.observe(2, 1, 3, 1.3, bucket(Draft([1], match=12)))
    assert spec.costs.measured(3) == 1


def test_tries_while_no_draft_pays_cost_a_bounded_share():
    """Nothing is kept: one draft is still tried now and then, spaced so that the tries cost at most
    PROBE_SHARE of the time ((t(2) - t(1)) / t(1) / PROBE_SHARE steps), each rejected try doubling the spacing;
    a kept one brings it back. Plain steps cost nothing more than the lookup: prompt lookup never retires."""
    from localmoe.engine.spec.speculator import PROBE, PROBE_MAX, PROBE_SHARE

    for cost in (1.1, 1.2, 2.0):  # a 2-row verify at 1.1 / 1.2 / 2 plain steps
        first = max(PROBE, round((cost - 1.0) / PROBE_SHARE))
        spec = Speculator(Verified(), k=4)
        yardstick(spec)
        for _ in range(30):
            spec.observe(1, 0, 2, cost, 1)
        gaps, plain, total = [], 0, 0
        while total < 4000:
            total += 1
            k = spec.choose_k()
            draft = spec.fit(Draft([7, 8, 9, 10][:k], match=1)) if k else Draft([])
            if draft.tokens:
                gaps.append(plain)
                plain = 0
                spec.observe(len(draft.tokens), 0, 1 + len(draft.tokens), cost, 1)
            else:
                plain += 1
                spec.observe(0, 0, 1, 1.0)
        assert not spec.retired
        assert first - 1 <= gaps[0] <= first and gaps[1] >= 2 * gaps[0] - 1 and max(gaps) <= PROBE_MAX
        assert len(gaps) * (cost - 1.0) <= PROBE_SHARE * total * 1.5
    spec = Speculator(Verified(), k=4)  # a kept try: the spacing is PROBE again
    yardstick(spec)
    spec.observe(1, 0, 2, 1.2, 1)
    spec._backoff[1] = 8
    spec._probing = True
    spec.observe(1, 1, 2, 1.2, 1)
    assert spec._backoff[1] == 1


def test_a_class_rejected_early_is_tried_again_while_longer_matches_draft():
    """Each class's tries are spaced on their own: a class whose first draft was rejected is tried again after
    (t(2) - t(1)) / t(1) / PROBE_SHARE steps although longer matches draft every other step (a try shared by
    all classes was put off by every draft of another class, so one early rejection shut a class for good)."""
    from localmoe.engine.spec.speculator import PROBE_SHARE

    spec = Speculator(Verified(), k=4)
    yardstick(spec)
    spec.observe(1, 0, 2, 1.3, bucket(Draft([1], match=2)))  # a 2-3 token match's draft rejected
    assert spec.fit(Draft([1], match=2)).tokens == []  # its class no longer pays
    tried = []
    for step in range(200):
        spec.choose_k()
        if step % 2:
            assert spec.fit(Draft([1, 2, 3, 4], match=9)).tokens == [1, 2, 3, 4]
            spec.observe(4, 4, 5, 2.0, bucket(Draft([1], match=9)))
        elif spec.fit(Draft([1], match=2)).tokens:
            tried.append(step)
            spec.observe(1, 0, 2, 1.3, bucket(Draft([1], match=2)))
        else:
            spec.observe(0, 0, 1, 1.0)
    spacing = (1.3 - 1.0) / PROBE_SHARE
    assert tried and tried[0] <= spacing + 2 and len(tried) <= 200 / spacing + 1


class Scripted:
    """A deterministic drafter with match lengths whose draft at position n is `draft(n)` (a 2-3 token match's), over
    a sequence that yields `answer(n)` there: its index (`_mlen`, `shadow`) as PromptLookup's, a key a token."""

    name, free, matches, deterministic = "scripted", True, True, True

    def __init__(self, draft, answer):
        self.draft, self.answer, self.history = draft, answer, list(range(100, 140))
        self._mlen = [2] * len(self.history)

    def shadow(self, i: int, k: int):
        tokens = self.draft(i + 1)[:k]
        for j, t in enumerate(tokens):
            if i + 1 + j >= len(self.history):
                return None
            if t != self.history[i + 1 + j]:
                return j, len(tokens)
        return len(tokens), len(tokens)

    def grow(self, tokens) -> None:
        self.history += tokens
        self._mlen += [2] * len(tokens)


def shadow_steps(spec, steps: int) -> int:
    """Steps of a sequence drafted by `Scripted` (spec.drafter) after a verify measured 5 rows at 1.6 plain steps ->
    the drafts verified."""
    d = spec.drafter
    yardstick(spec)
    spec.observe(4, 4, 5, 1.6, bucket(Draft([1], match=12)))
    verified = 0
    for _ in range(steps):
        k = spec.choose_k()
        at = len(d.history)
        tokens = d.draft(at)[:k] if k else []
        kept = spec.fit(Draft(tokens, match=2), at).tokens if tokens else []
        if kept:
            verified += len(kept)
            j = 0
            while j < len(kept) and kept[j] == d.answer(at + j):
                j += 1
            spec.observe(len(kept), j, 1 + len(kept), 1.0 + 0.15 * len(kept), bucket(Draft([1], match=2)))
            d.grow([d.answer(at + i) for i in range(j + 1)])
        else:
            spec.observe(0, 0, 1, 1.0)
            d.grow([d.answer(at)])
    return verified


def test_a_class_that_does_not_pay_is_tried_in_the_shadow_not_by_a_verify():
    """Prompt lookup (deterministic): a 2-3 token match's drafts, priced below paying, are looked at in the
    shadow after the fact (no verify, no lookup on the steps between) and compared with the tokens the sequence
    yielded: every such key is a try. Where they are mostly right the class's acceptance rises from those
    comparisons alone until its drafts are verified; where they are wrong no verify runs at all. A drafter tried
    by verifies instead verifies its rejected drafts now and then."""
    right = Speculator(Scripted(lambda n: [n, n + 1, n + 2, n + 3], lambda n: n), k=4)
    right._bucket_trials[2], right._bucket_kept[2] = 3.0, 0.0  # three early rejections: the class does not pay
    verified = shadow_steps(right, 60)
    assert right.shadow_tries >= 1 and right.shadow_kept == right.shadow_tries
    assert right._priced_classes()[2][0] > 0 and verified > 20  # verified and kept once the shadows said so
    wrong = Speculator(Scripted(lambda n: [-n, 1, 2, 3], lambda n: n), k=4)
    wrong._bucket_trials[2] = 3.0  # (at its prior alone, a class 2 draft pays over rows this cheap)
    assert shadow_steps(wrong, 300) == 0
    assert wrong.shadow_tries >= 250 and wrong.shadow_kept == 0  # every key but the last few (undecided yet)
    assert wrong.bucket_acceptance(2)[0] < 0.2  # (its prior, weight PRIOR, against decayed counts of ~5)
    verifies = Speculator(Verified(), k=4)
    verifies.drafter.draft, verifies.drafter.answer = (lambda n: [-n, 1, 2, 3]), (lambda n: n)
    verifies.drafter.history = list(range(100, 140))
    verifies.drafter.grow = verifies.drafter.history.extend
    verifies._bucket_trials[2] = 3.0
    assert shadow_steps(verifies, 300) > 0 and verifies.shadow_tries == 0


def test_a_review_prices_only_the_classes_whose_acceptance_rose(monkeypatch):
    """The review of shadow tries prices a class again only where its p or c rose: a class's tokens per second rise
    with both, so one that did not pay and whose tries were rejected still does not (its memo entry, k 0 at a plain
    step's rate, stands). A free answer's tries, mostly rejected, then price nothing; the choices are those of
    pricing every class afresh at the memo's costs, and a class whose tries are kept is priced in as before."""
    wrong = Speculator(Scripted(lambda n: [-n, 1, 2, 3], lambda n: n), k=4)
    wrong._bucket_trials[2] = 3.0  # three early rejections: the class does not pay (p below its prior)
    repriced = []
    reprice = wrong._reprice
    monkeypatch.setattr(wrong, "_reprice", lambda classes: repriced.append(list(classes)) or reprice(classes))
    assert shadow_steps(wrong, 100) == 0 and wrong.shadow_tries >= 90 and wrong.shadow_kept == 0
    assert repriced == []
    assert wrong._memo == [wrong._best(wrong.bucket_acceptance(b), wrong._memo_costs) for b in range(BUCKETS)]
    right = Speculator(Scripted(lambda n: [n, n + 1, n + 2, n + 3], lambda n: n), k=4)
    right._bucket_trials[2] = 3.0
    repriced.clear()
    reprice_right = right._reprice
    monkeypatch.setattr(right, "_reprice", lambda classes: repriced.append(list(classes)) or reprice_right(classes))
    assert shadow_steps(right, 60) > 20 and [2] in repriced  # kept tries: priced in, then verified


def test_a_shadow_try_settles_at_the_first_difference_or_once_its_keys_are_indexed():
    """After the fact, over the index: the draft a key's match had, against the keys that followed it."""
    lookup = PromptLookup()
    lookup.propose([7, 8, 9, 5, 7, 8], 1)  # key 5 (8) matched [7, 8] at key 1: its draft 9, 5, ... (at most 4 keys)
    assert lookup._mlen[5] == 2 and lookup.shadow(5, 4) is None  # nothing after it yet
    lookup.propose([7, 8, 9, 5, 7, 8, 9, 5], 1)
    assert lookup.shadow(5, 4) is None  # two agree, the third and fourth (7, 8) not yielded yet
    lookup.propose([7, 8, 9, 5, 7, 8, 9, 5, 7, 3], 1)
    assert lookup.shadow(5, 4) == (3, 4)  # parts at the fourth: three kept of four
    assert lookup.shadow(5, 2) == (2, 2)
    spec = Speculator(PromptLookup(), k=4)
    spec.settle_shadow(2, 2, 3)  # the first kept, and of the two further ones reached, one
    assert spec.shadow_tries == 1 and spec.shadow_kept == 1
    assert (spec._bucket_kept[2], spec._bucket_trials[2], spec._more_kept[2], spec._more_trials[2]) == (1, 1, 1, 2)
    spec.settle_shadow(2, 0, 1)  # parts at once: nothing kept (no further draft reached)
    assert spec.shadow_tries == 2 and spec.shadow_kept == 1 and spec._bucket_trials[2] == 0.8 * 1 + 1
    assert spec._more_trials[2] == 2


def test_prompt_lookup_with_shadow_tries_greedy_equals_plain(model):
    """The adaptive speculator over a real model: shadow tries and verifies mixed, the text unchanged."""
    prompt = prompt_for(model)
    want, _ = run(model, prompt)
    spec = Speculator(PromptLookup(), k=4)
    got, _ = run(model, prompt, speculator=spec)
    assert got == want


def test_a_retired_speculator_stops_the_states_kept_for_rollback(tmp_path):
    """A verify leaves a delta-rule layer keeping a state per token until the next step; once the speculator
    retires, or declines to draft (the plain step), the next step stops that (else a state per token is kept
    until the sequence ends)."""
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("kimi_linear", tmp_path, "tiny", seed=0)
    model = load_model(path, EngineConfig(dtype="float32", threads=1), progress=False).model
    class Repeat:  # drafts the last token again: every step verifies
        name = "repeat"

        def propose(self, history, k, params, generator):
            return Draft([history[-1]])

    for stop in ("retire", "decline"):
        spec = Speculator(Repeat(), k=1, adaptive=False)
        dec = Decoder(model, prompt_for(model), GREEDY, speculator=spec)
        states = dec.cache.recorders  # the delta-rule layers (an fp32 cache: no exact ring to keep)
        assert states
        for step in range(8):
            logits = dec.logits()
            if logits is None:
                continue
            if step == 5:  # after a verify (recording on): the speculator retires, or declines from now on
                assert dec.recording
                if stop == "retire":
                    spec.retired = True
                else:
                    spec.drafter = NoDraft()
            dec.feed([dec.sample(logits)])
        assert not dec.recording and all(layer._recording is None for layer in states)


class _Pager:
    """What Residency reads of a Pager: resident keys, prefetch, the stall and miss counters."""

    def __init__(self, resident):
        from types import SimpleNamespace

        self.held = set(resident)
        self.asked: list[tuple[int, list[int]]] = []
        self.stats = SimpleNamespace(ram=SimpleNamespace(stall_seconds=0.0, misses=0))

    def resident(self):
        return set(self.held)

    def prefetch(self, layer, experts):
        self.asked.append((layer, list(experts)))
        return len(experts)


def _residency(resident):
    import torch

    from localmoe.engine.spec.residency import Residency, RouteBook

    book = RouteBook()
    res = Residency(_Pager(resident), book)

    class Cache:
        max_len, hidden_sink = 32, None

    cache = Cache()
    res.watch(cache)
    # a forward of 6 positions (0..5) through MoE layers 1 and 3, top-2: position p chose experts p, p + 1
    for layer in (1, 3):
        book.record(layer, torch.tensor([[p, p + 1] for p in range(6)]))
    cache.hidden_sink(0, torch.arange(6), torch.zeros(6, 4), True)
    return res


def test_residency_predicts_a_copied_drafts_experts_and_what_it_must_read():
    res = _residency({(1, 2), (1, 3), (3, 2), (3, 3)})
    keys = res.predicted(2, 2)  # drafts copied from positions 2 and 3
    assert keys == [{(1, 2), (1, 3), (3, 2), (3, 3)}, {(1, 3), (1, 4), (3, 3), (3, 4)}]
    assert res.missing(keys) == [0, 2]  # the second draft adds (1, 4) and (3, 4)
    assert res.predicted(5, 3)[1:] == [set(), set()]  # positions not run yet: nothing predicted
    res.prefetch(keys)
    assert res.pager.asked == [(1, [2, 3, 4]), (3, [2, 3, 4])]


def test_fit_cuts_a_draft_where_its_experts_must_be_read():
    """Priced: compute grows little with the rows, but each expert missed stalls 0.5 s. The pending token stood at
    position 1 (the draft copies 2.. on): its missing experts (1, 1) and (3, 1) are read by a plain step too, so
    they are not the draft's cost; the first draft adds none (kept), the next ones add (1, 4), (3, 4) (dropped)."""
    spec = Speculator(PromptLookup(), k=4, residency=_residency({(1, 2), (1, 3), (3, 2), (3, 3)}))
    ram = spec.residency.pager.stats.ram
    for rows, drafted, kept, stall, misses in [(1, 0, 0, 0.5, 1), (5, 4, 4, 0.5, 1)] * 10:
        spec.choose_k()
        ram.stall_seconds += stall
        ram.misses += misses
        spec.observe(drafted, kept, rows, 0.1 * rows + stall)
    assert spec.miss_seconds == pytest.approx(0.5)
    assert spec.step_misses[1] == pytest.approx(1) and spec.step_misses[5] == pytest.approx(1)
    draft = spec.fit(Draft([7, 8, 9], source=2))
    assert draft.tokens == [7] and draft.source == 2
    assert spec.residency.pager.asked == [(1, [2, 3]), (3, [2, 3])]
    spec.residency.pager.held |= {(1, 4), (3, 4), (1, 5), (3, 5)}
    assert spec.fit(Draft([7, 8, 9], source=2)).tokens == [7, 8, 9]
    assert spec.fit(Draft([7, 8])).tokens == [7, 8]  # not copied: nothing predicted, left to choose_k


def test_steps_are_timed_in_cpu_time_unless_a_step_may_wait_for_reads():
    """Where the experts are in memory a step's cost is the process's CPU time (wall time on a loaded host
    measures the neighbours); where a provider may wait for reads (a pager, the store's page cache), wall time."""
    import time
    from types import SimpleNamespace

    from localmoe.engine.spec.verify import step_clock
    from localmoe.paging import StoreExperts
    from localmoe.paging.pager import Pager

    def model(experts):
        return SimpleNamespace(moe_blocks=lambda: [SimpleNamespace(experts=e) for e in experts])

    assert step_clock(model([])) is time.process_time
    assert step_clock(model([object()])) is time.process_time
    for provider in (Pager, StoreExperts):
        assert step_clock(model([object(), provider.__new__(provider)])) is time.perf_counter


class Declines(PromptLookup):
    """Prompt lookup's traits (free, match lengths, deterministic: its choice settles), a drafter that never has a
    draft and counts how often it is asked."""

    def __init__(self):
        super().__init__()
        self.asked = 0

    def propose(self, history, k, params=None, generator=None, least: int = 1):
        self.asked += 1
        return super().propose([], k)

    def hopeless(self, length: int, least: int) -> bool:
        return False

    def quiet(self, length: int, least: int) -> int:
        return 0


@pytest.mark.parametrize("fused", [True, False])
def test_a_settled_declining_step_is_the_plain_step_in_one_call(tmp_path, monkeypatch, fused):
    """A lone sequence whose choice is settled and whose drafter has no draft takes off's plain step from
    decode_together through one call (`Speculator.decline`): no speculative_step, no choose_k, no `_propose` but on
    the steps whose choice is taken afresh (every SETTLE steps at most); the drafter is asked once a step, every
    step is counted, one plain step in TIME_EVERY is timed, and the text is the plain run's (counted, not timed)."""
    from .conftest import build_model

    from localmoe.engine.spec import verify
    from localmoe.engine.spec.speculator import SETTLE, TIME_EVERY

    model = build_model("llama", tmp_path)
    prompt = random_tokens(24, 3, model.spec.vocab_size)[0].tolist()
    steps = 64
    want = _greedy_steps(model, prompt, fused=fused, n=steps)
    full, timed = [], []
    propose = verify._propose
    monkeypatch.setattr(verify, "_propose", lambda dec: full.append(1) or propose(dec))
    spec = Speculator(Declines(), k=4)
    chosen = []
    choose_k = spec.choose_k
    monkeypatch.setattr(spec, "choose_k", lambda: chosen.append(1) or choose_k())
    got = _greedy_steps(model, prompt, fused=fused, speculator=spec, n=steps)
    full_steps = len(full)
    costs = spec.costs
    plain = costs.plain
    monkeypatch.setattr(costs, "plain", lambda seconds: timed.append(seconds) or plain(seconds))
    more = _greedy_steps(model, prompt, fused=fused, speculator=Speculator(Declines(), k=4), n=steps)
    assert got == want == more and spec.stats.drafted == 0
    assert spec.stats.steps == spec.stats.emitted == steps - 1  # every step counted (the first came from the prompt)
    assert spec.drafter.asked >= steps - 3  # asked at every step once t(1) is known (two plain steps: yardstick)
    assert full_steps == len(chosen) <= steps / SETTLE + 3  # the full step only where the choice is taken afresh
    assert 0 < len(timed) <= (steps - 1) / TIME_EVERY + 2  # (another sequence on the model: t(1) known)


class Sometimes:
    """Free, with match lengths, not deterministic: a long match's (wrong) draft at every 8th call, none between;
    counts the calls."""

    name, free, matches = "sometimes", True, True

    def __init__(self):
        self.asked = 0

    def propose(self, history, k, params=None, generator=None, least: int = 1):
        self.asked += 1
        return Draft([1] * k, match=16) if self.asked % 8 == 0 else Draft([])


def test_a_drafter_is_asked_once_a_step_where_the_settled_look_finds_a_draft(tmp_path):
    """Where `Speculator.decline`'s look finds a draft, the full step verifies that draft: a drafter whose draft is
    not a function of the history alone is not asked twice in a step; the text is the plain run's."""
    from .conftest import build_model

    model = build_model("llama", tmp_path)
    prompt = random_tokens(24, 3, model.spec.vocab_size)[0].tolist()
    steps = 48
    want = _greedy_steps(model, prompt, fused=True, n=steps)
    spec = Speculator(Sometimes(), k=4)
    got = _greedy_steps(model, prompt, fused=True, speculator=spec, n=steps)
    assert got == want and spec.stats.drafted_steps > 0
    assert spec.drafter.asked <= spec.stats.steps  # once a step at most (a verify's steps yield one token or more)


class Unique(PromptLookup):
    """Prompt lookup over a sequence with nothing to copy: every token's key is new (no match ever)."""

    def _key(self, token: int):
        self._count = getattr(self, "_count", 0) + 1
        return self._count


@pytest.mark.parametrize("fused", [True, False])
def test_a_sequence_with_nothing_to_copy_takes_no_lookup_per_step(tmp_path, monkeypatch, fused):
    """Where no match can pay, the steps that certainly cannot find one (a match grows by a token a step at most) go
    to decode_together's plain step without the speculator: the lookup and the speculator run on a few of the steps,
    not on each (counted, not timed), and the text is the plain run's. No more than those: a quote may start at the
    next step (sessions 13-14 rested more and more steps past them, and a code edit rested through its quotes)."""
    from .conftest import build_model

    from localmoe.engine.spec import verify

    model = build_model("llama", tmp_path)
    prompt = random_tokens(24, 3, model.spec.vocab_size)[0].tolist()
    steps = 48
    want = _greedy_steps(model, prompt, fused=fused, n=steps)
    calls = []  # steps that ran the speculator: the full one (_propose) or the settled one's look (`decline`)
    propose = verify._propose
    monkeypatch.setattr(verify, "_propose", lambda dec: calls.append(1) or propose(dec))
    spec = Speculator(Unique(), k=4)
    decline = spec.decline

    def looked(dec, step, fused, look=True):
        results = decline(dec, step, fused, look)
        if look and results is not None:
            calls.append(1)
        return results

    spec.decline = looked
    got = _greedy_steps(model, prompt, fused=fused, speculator=spec, n=steps)
    assert got == want and spec.stats.drafted == 0
    assert spec.least >= 4  # (no verify measured: only long matches' classes pay at the pessimistic first cost)
    assert len(calls) <= steps / 3 and spec.drafter.indexed <= len(calls)
    assert len(calls) >= (steps - 1) / spec.least - 1  # once in `least` steps: a match of `least` keys is possible
    spec.wake()
    assert spec.stats.steps == steps - 1  # every step counted (the first token came from the prompt's forward)


def test_a_finished_sequence_counts_the_steps_it_rested(tmp_path):
    """The statistics of a finished sequence (a turn's, /metrics) count its last steps taken without the speculator
    (`rest`): `Decoder.release` wakes it."""
    from .conftest import build_model

    model = build_model("llama", tmp_path)
    prompt = random_tokens(24, 3, model.spec.vocab_size)[0].tolist()
    spec = Speculator(Unique(), k=4)
    dec = Decoder(model, prompt, GREEDY, speculator=spec)
    tokens = 0
    while tokens < 30 or spec.quiet == spec._quiet_set and tokens < 60:  # (until it ends inside a rest)
        logits = decode_together([dec], fused=True)[0] if dec.decoding and not dec.ready else dec.logits()
        if logits is not None:
            tokens += 1
            dec.feed([dec.sample(logits)])
    assert spec.quiet < spec._quiet_set  # it rested at the end
    dec.release()
    assert spec.stats.steps == spec.stats.emitted == tokens - 1
