"""Class 0's pricing (a draft model's, MTP's drafts: no match length says how likely one is kept): one early
rejection does not switch the drafter off for the rest of the sequence, a drafter whose drafts are never kept is
still turned down within a few verifies, and a model's drafts beside a lookup (hybrid.py) are tried again once
priced out. The target is scripted: which drafts it keeps, and what a step of r rows costs (a paged store's verify:
each row reads its experts)."""

from __future__ import annotations

from localmoe.engine.spec.drafters import Draft
from localmoe.engine.spec.speculator import PROBE_MAX, RETIRE_AFTER, Speculator, bucket

from .test_draft_ahead import Mixed  # hybrid.py's drafter as the speculator sees it (lookup classes 1..4, model 0)

ROW = 0.3  # each row past the first costs this share of a plain step


class Model:
    """A drafter without match lengths (the speculator's view of a draft model): class 0 only."""

    name = "model"


def steps(spec, kept, n, draft=lambda k: Draft(list(range(k)))) -> list[int]:
    """Run `n` steps: each asks for k, fits the draft and verifies it, `kept(step, drafts)` of them kept; a plain step
    costs 1, r rows 1 + ROW (r - 1). -> the drafts verified per step (0: a plain step); stops once retired."""
    verified = []
    for step in range(n):
        k = spec.choose_k()
        if spec.retired:
            break
        tokens = spec.fit(draft(k)).tokens if k else []
        if tokens:
            d = Draft(tokens)
            spec.observe(len(tokens), kept(step, len(tokens)), len(tokens) + 1, 1 + ROW * len(tokens), bucket(d))
        else:
            spec.observe(0, 0, 1, 1.0)
        verified.append(len(tokens))
    return verified


def test_one_early_rejection_does_not_retire_a_drafter_whose_later_drafts_are_kept():
    """The first verify (one draft: how likely a draft is kept is unknown until tried) rejected, every later draft
    kept: the drafter measures a second verify, is tried again before it would retire, and drafts for the rest of
    the sequence."""
    spec = Speculator(Model(), k=4)
    first = []

    def kept(step, drafts):
        if not first:
            first.append(step)
            return 0
        return drafts

    verified = steps(spec, kept, 200)
    assert not spec.retired and len(verified) == 200
    assert verified[first[0]] == 1 and verified[first[0] + 1] == 1  # measured again at once (one draft)
    # (kept at 0.59, one draft does not pay for 2 rows priced near the prior's 2 plain steps here: tried again
    # where it would have retired, kept, and drafting from then on)
    later = first[0] + RETIRE_AFTER + 3
    assert sum(1 for v in verified[later:] if v) >= 0.95 * (200 - later)
    assert max(verified) == 4 and spec.acceptance > 0.9


def test_a_drafter_never_kept_is_turned_down_within_two_verifies():
    """Every draft rejected (a random draft model): one try after the first verify, then retired, at the step the
    old rule retired it or one later (the try's own): two rejected 2-row verifies at most."""
    spec = Speculator(Model(), k=4)
    verified = steps(spec, lambda step, drafts: 0, 200)
    assert spec.retired
    assert len(verified) <= 4 + RETIRE_AFTER
    assert [v for v in verified if v] in ([1], [1, 1])  # (the first verify, and one try at most)


def test_a_drafter_kept_one_time_in_two_retires_after_a_few_tries():
    """Drafts kept one time in two (on alternate steps): the tries before retiring end with the first rejected
    verify after one that was kept, within a few verifies, and the sequence goes back to plain steps."""
    spec = Speculator(Model(), k=4)
    verified = steps(spec, lambda step, drafts: step % 2, 400)
    assert spec.retired and len(verified) <= 2 * RETIRE_AFTER + 8
    assert 2 <= sum(1 for v in verified if v) <= 5


def test_the_models_drafts_beside_a_lookup_are_tried_once_priced_out():
    """A hybrid drafter (class 0 the model's, beside the lookup's classes) whose first model draft was rejected and
    whose later ones would be kept: a model draft is tried again (within PROBE_MAX steps, the probe share's spacing)
    and, kept, drafts again; before, class 0 was left to the shadow tries, which a model's drafts have none of."""
    spec = Speculator(Mixed(), k=4)
    for _ in range(3):
        spec.observe(0, 0, 1, 1.0)
    spec.observe(1, 0, 2, 1 + ROW, 0)  # the first model draft: rejected
    assert spec.choose_k() > 0 and spec.fit(Draft([5, 6, 7, 8])).tokens == []  # class 0 priced out
    verified = steps(spec, lambda step, drafts: drafts, PROBE_MAX + 8, lambda k: Draft([5, 6, 7, 8][:k]))
    assert not spec.retired
    again = next(i for i, v in enumerate(verified) if v)
    assert verified[again] == 1 and again <= PROBE_MAX
    later = again + RETIRE_AFTER + 3  # (a kept try at 0.59 may not pay yet: one more where it would retire)
    assert sum(verified[later:later + 30]) >= 0.9 * 4 * 30  # the model's drafts verified again, 4 a step
