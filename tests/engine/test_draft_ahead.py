"""A draft model drafting ahead (engine/spec/draft_model.py `ahead`): a thread carries its continuation on while the
target verifies. Greedy output equals the plain run token for token with a draft that is mostly kept (the target
itself: the thread's drafts are taken) and one that is mostly rejected (another model: the thread is stopped and the
cache trimmed back), over a delta-rule target and a sliding-window one; the thread's drafts are the ones drafting
inline makes; the prompt's catch-up runs in the thread on steps without a draft (`follow`) and as a prefill whose
block matrices run their kernel (no fp32 copy). The hybrid (engine/spec/hybrid.py: prompt lookup after a long match,
the draft model elsewhere) likewise, its model's drafts priced as a class of their own."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.spec.draft_model import ROWS, DraftModel
from localmoe.engine.spec.drafters import Draft, PromptLookup
from localmoe.engine.spec.hybrid import LookupThenModel
from localmoe.engine.spec.speculator import BUCKETS, RETIRE_AFTER, Speculator
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

from .test_speculative import GREEDY, prompt_for
from .test_speculative import run as speculative_run


@pytest.fixture(scope="module", params=["kimi_linear", "gpt_oss"])
def models(request, tmp_path_factory):
    """(target, another model of its family: the same vocabulary, other weights)."""
    config = EngineConfig(dtype="float32", threads=1, expert_precision="exact")
    root = tmp_path_factory.mktemp(request.param)
    return tuple(load_model(write_checkpoint(request.param, root / str(seed), "tiny", seed=seed), config,
                            progress=False).model for seed in (0, 1))


def run(model, prompt, speculator=None) -> list[int]:
    """40 greedy tokens (test_speculative's run: the plain batched step without a speculator)."""
    return speculative_run(model, prompt, speculator=speculator)[0]


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_drafting_ahead_greedy_equals_plain(models, draft):
    target, other = models
    prompt = prompt_for(target)
    want = run(target, prompt)
    drafter = DraftModel(target if draft == "itself" else other, target.spec.vocab_size, ahead=True)
    spec = Speculator(drafter, k=3, adaptive=False)
    assert run(target, prompt, spec) == want
    drafter._join(None)
    if draft == "itself":  # every draft kept: the next step's drafts were the thread's, and right
        assert drafter.carried > 0.5 * spec.stats.drafted_steps, (drafter.carried, spec.stats)
        assert spec.stats.acceptance > 0.8, spec.stats
    else:  # mostly rejected: the thread's branch dropped, the cache back at the accepted point
        assert spec.stats.drafted > spec.stats.accepted
        assert drafter.cache.offset == len(drafter.tokens)


def test_the_threads_drafts_are_the_ones_drafting_inline_makes(models):
    target, other = models
    prompt = prompt_for(target)
    history = prompt + run(target, prompt)[:6]
    ahead, inline = (DraftModel(other, target.spec.vocab_size, ahead=a) for a in (True, False))
    first = ahead.propose(history[:-4], 2, GREEDY, None)  # the thread carries on past these two drafts
    assert first.tokens == inline.propose(history[:-4], 2, GREEDY, None).tokens
    # the target kept both and yielded the draft's own guess: the next drafts are the thread's
    ahead._thread.join()
    at = len(history) - 4 + 2
    taken = history[:-4] + first.tokens + [(ahead.tokens + [ahead.next])[at]]
    got = ahead.propose(taken, 2, GREEDY, None)
    assert ahead.carried == 1 and ahead.caught_up == 0
    assert got.tokens == inline.propose(taken, 2, GREEDY, None).tokens
    # a history off the thread's branch: trimmed back, caught up, the same drafts as inline
    off = history[:-1]
    assert ahead.propose(off, 3, GREEDY, None).tokens == inline.propose(off, 3, GREEDY, None).tokens
    assert ahead.carried == 1 and ahead.thread_seconds() > 0


def test_the_prompts_catch_up_runs_beside_a_step_without_a_draft(models):
    target, other = models
    prompt = prompt_for(target)
    drafter = DraftModel(other, target.spec.vocab_size, ahead=True)
    drafter.follow(prompt)  # a step that does not draft: the thread catches up on the prompt
    assert drafter._thread is not None
    draft = drafter.propose(prompt + [3], 2, GREEDY, None)
    assert drafter.caught_up <= ROWS  # the step's own tokens only
    assert draft.tokens == DraftModel(other, target.spec.vocab_size).propose(prompt + [3], 2, GREEDY, None).tokens


def test_a_draft_ends_before_its_first_unsure_token(models):
    """`confident`: the draft stops before the first token the draft model gives less probability; every token
    drafted is one it gives at least that much."""
    import torch

    target, other = models
    history = prompt_for(target)
    full = DraftModel(other, target.spec.vocab_size).propose(history, 5, GREEDY, None).tokens
    sure = DraftModel(other, target.spec.vocab_size, confident=1e-9).propose(history, 5, GREEDY, None).tokens
    assert sure == full
    assert DraftModel(other, target.spec.vocab_size, confident=1.5).propose(history, 5, GREEDY, None).tokens == []
    # a threshold between the drafts' own probabilities cuts at the first token under it
    probe = DraftModel(other, target.spec.vocab_size)
    probs = []
    for i, token in enumerate(full):
        cache = probe.model.new_cache(1, 128)
        logits = probe._fit(probe.model.forward(torch.tensor([history + full[:i]]), cache)[:, -1])
        probs.append(float(torch.softmax(logits[0], -1)[token]))
    cut = sorted(probs)[len(probs) // 2]
    want = next((i for i, p in enumerate(probs) if p < cut), len(probs))
    got = DraftModel(other, target.spec.vocab_size, confident=cut).propose(history, 5, GREEDY, None).tokens
    assert got == full[:want]


@pytest.mark.parametrize("confident", [0.0, 1e-9])
def test_a_history_that_ends_with_the_models_own_last_choice(models, confident):
    """The target kept every draft and yielded the draft model's own next choice, which it had not run yet: that
    token is run first, and the drafts after it are the ones a fresh draft model makes."""
    target, other = models
    history = prompt_for(target)
    drafter = DraftModel(other, target.spec.vocab_size, confident=confident)
    first = drafter.propose(history, 2, GREEDY, None).tokens
    taken = history + first  # the second draft is `next`: chosen, not run
    assert len(drafter.tokens) == len(taken) - 1 and drafter.next == taken[-1]
    got = drafter.propose(taken, 3, GREEDY, None).tokens
    assert drafter.carried == 1 and len(got) == 3
    assert got == DraftModel(other, target.spec.vocab_size).propose(taken, 3, GREEDY, None).tokens


@pytest.mark.parametrize("draft", ["itself", "another"])
@pytest.mark.parametrize("ahead", [True, False])
def test_the_hybrid_greedy_equals_plain(models, draft, ahead):
    """Prompt lookup's drafts where the sequence repeats itself (here after any match: `long` 1), the draft model's
    elsewhere: the plain run's tokens, and both drafters used. (The prompt holds a prompt and its plain answer, then
    the prompt again: a tiny random model's answer then repeats some of it.)"""
    target, other = models
    prompt = prompt_for(target)
    prompt = prompt + run(target, prompt)[:16] + prompt
    want = run(target, prompt)
    model = DraftModel(target if draft == "itself" else other, target.spec.vocab_size, ahead=ahead)
    drafter = LookupThenModel(PromptLookup(), model, long=1)
    spec = Speculator(drafter, k=3, adaptive=False)
    assert run(target, prompt, spec) == want
    model._join(None)
    assert 0 < drafter.lookups < spec.stats.drafted_steps, (drafter.lookups, spec.stats)
    assert model.cache.offset == len(model.tokens)


def test_a_lookup_step_catches_the_draft_model_up_beside_the_verify(models):
    """Where the lookup drafts, the model's thread runs the sequence and that draft (the branch where the verify
    keeps it all): a later step the model drafts for catches up on the step's own token alone, and drafts what a
    fresh model drafts there."""
    target, other = models
    prompt = prompt_for(target)  # its last 10 tokens repeat its start: a 10-token match
    model = DraftModel(other, target.spec.vocab_size, ahead=True)
    drafter = LookupThenModel(PromptLookup(), model, long=4)
    draft = drafter.propose(prompt, 3, GREEDY, None)
    assert draft.match >= 4 and draft.tokens == prompt[draft.source:draft.source + 3] and drafter.lookups == 1
    assert model._thread is not None  # beside the verify
    model._join(None)
    assert model.tokens == prompt + draft.tokens
    taken = prompt + draft.tokens + [7]  # every draft kept, then the target's own token
    got = LookupThenModel(PromptLookup(), model, long=64).propose(taken, 2, GREEDY, None)
    assert model.caught_up == 1 and got.match == 0
    assert got.tokens == DraftModel(other, target.spec.vocab_size).propose(taken, 2, GREEDY, None).tokens


class Mixed:
    """A drafter like hybrid.py's as the speculator sees it: match classes 1..4 from a lookup, class 0 a model's."""

    name = "mixed"
    matches = deterministic = mixed = True
    _mlen: list[int] = []

    def shadow(self, i, k):
        return None

    def propose(self, history, k, params, generator, least=1):
        return Draft([])


def test_the_models_drafts_are_priced_as_a_class_of_their_own():
    """The lookup's drafts rejected in every class, the model's (class 0) kept: the model's drafts are verified whole
    and the lookup's dropped, class 0's acceptance is its own drafts' alone, and the drafter is not retired."""
    spec = Speculator(Mixed(), k=4)
    for _ in range(20):
        spec.choose_k()
        spec.observe(4, 4, 5, 3.0, 0)  # 5 rows cost 3 plain steps (a paged store's)
        for b in range(1, BUCKETS):
            spec.choose_k()
            spec.observe(4, 0, 5, 3.0, b)
        spec.choose_k()
        spec.observe(0, 0, 1, 1.0)
    assert spec.bucket_acceptance(0)[0] > 0.95
    assert spec.choose_k() == 4
    assert spec.fit(Draft([1, 2, 3, 4])).tokens == [1, 2, 3, 4]
    assert spec.fit(Draft([1, 2, 3, 4], match=12)).tokens == []
    for _ in range(RETIRE_AFTER):
        spec.choose_k()
    assert not spec.retired


def test_the_catch_up_runs_the_block_kernels_as_a_prefill(smollm2_gguf):
    """The prompt's catch-up is one forward whose GGUF-block matrices run their block kernel on every row (each row's
    bits as it has alone: engine/quantized.py `block_rows`), not the fp32 GEMM on a dequantised copy: no copy is
    made, and the logits are the fp32 path's within the int8 rounding of x."""
    from localmoe.engine.quantized import BlockLinear, block_rows
    from localmoe.kernels import ggml_gemv

    if not ggml_gemv.kernel_available():
        pytest.skip("the CPU kernel library is not built here")
    model = load_model(smollm2_gguf, EngineConfig(threads=1), progress=False).model
    blocks = _found(model, BlockLinear)
    assert len(blocks) > 60, "the embedded model's GGUF-block matrices not found"
    lin = blocks[0]
    x = torch.randn(40, lin.in_features)
    with block_rows():
        rows = lin(x)
    assert torch.equal(rows, torch.cat([lin(x[i:i + 1]) for i in range(40)]))
    prompt = list(range(100, 140))
    drafter = DraftModel(model, model.spec.vocab_size)
    drafter.follow(prompt)  # (not ahead: no thread)
    got = drafter._sync(prompt)
    assert drafter.caught_up == 40 > ROWS
    assert all(m._dense is None for m in blocks), "the catch-up made the fp32 copies of the prefill GEMM"
    want = model.forward(torch.tensor([prompt]), model.new_cache(1, 64))[:, -1]  # the fp32 path (copies made)
    assert any(m._dense is not None for m in blocks)
    assert int(got.argmax()) == int(want.argmax())
    assert torch.allclose(got, want[:, :got.shape[-1]], atol=0.05 * float(want.abs().max()))


def _found(root, kind, depth: int = 5) -> list:
    """The objects of `kind` reachable from `root` through attributes, lists and tuples (each once)."""
    seen, out, todo = set(), [], [(root, 0)]
    while todo:
        obj, d = todo.pop()
        if id(obj) in seen or d > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            out.append(obj)
            continue
        if isinstance(obj, (list, tuple)):
            todo += [(o, d + 1) for o in obj]
        elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
            todo += [(o, d + 1) for o in vars(obj).values()]
    return out
