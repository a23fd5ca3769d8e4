"""One sequence's speculation: its drafter, the choice of k per step, its statistics.

k is chosen from what this sequence measured: the acceptance (from recent steps, kept apart per confidence class,
`bucket()`: a prompt-lookup draft after a long match is mostly kept, one after a single token mostly not, so `fit`
cuts each draft to what its class pays; per class two numbers, `bucket_acceptance`: p the chance that its first
draft is kept, c that a further one is once the one before it was), and from what a step of r rows costs on this
model: t(r) = t(1) x the model's ratio t(r) / t(1) (costs.py `StepCosts`: learned from every sequence's steps on the
model, a long window's median per row count, non-decreasing in r; so k follows acceptance, not the noise of one
sequence's few verifies), t(1) the median of the model's recent plain steps (the same table: the one place step
times are kept; CPU time, plus the pager's stall where a step may wait for expert reads: verify.py `step_clock`).
The drafter's own time is priced apart, per token it runs: a draft model runs its drafts and the tokens the step
yields. A step of k drafts yields E(k) = 1 + p (1 + c + ... + c^(k-1)) tokens on average for the time t(k + 1); the
k with the most tokens per second wins, and k = 0 (no draft: a plain decode step) when none beats a plain step by
GAIN (5%: a draft that only breaks even is a loss when the estimates err).

Row counts not measured yet on the model are estimated pessimistically (costs.py's prior: 2 rows at two plain
steps against a fused step, 1.3 where the plain step is the row kernels' too, `rows_plain`), so the first verify
is one that pays even so (a draft after a long match, mostly kept) and measuring costs little; a sequence takes
plain steps until the model's t(1) is known (the yardstick: two plain steps on a fresh model, the first of each row
count being its kernels' first use, costs.py). A drafter without match lengths (a draft model, MTP: how likely a
draft is kept is unknown until tried) drafts one token a step until this sequence measured a verify.

Probing: a draft of a class that does not pay is still tried now and then (a change in acceptance is noticed;
one early rejection of a class whose prior paid no longer shuts it for the rest of the sequence while longer
matches keep drafting), each try costing what a rejected 2-row verify costs over a plain step. Each class's tries
are spaced so that they cost at most PROBE_SHARE of the decode time ((t(2) - t(1) + the draft's own time) / t(1) /
PROBE_SHARE steps after the class's last verify, at least PROBE), and every try whose draft is rejected doubles
the class's spacing (up to PROBE_MAX steps) until one is kept.

Shadow tries (a deterministic drafter: prompt lookup, `Drafter.deterministic`). Its draft depends on the history
alone, so whether a draft would have been kept is seen for free a few steps later, in the tokens the sequence
yields: a class that does not pay is tried in the shadow instead of by a verify, after the fact (`_review`): the
index knows, for every key it took, the match it had there, so the draft of k_max keys a lookup would have made
at a key of that class is compared with the keys that followed it, and the ones kept until the first difference
count as a verify's would (`settle_shadow`; keys, so whitespace as the respaced draft compares it). Greedy:
what a verify would have kept; sampling: a one-hot draft token equals the sampled one with the probability the
acceptance rule keeps it. Every key of such a class is a try (session 13; before, one try every 2-64 steps, each
needing a lookup at every step until a draft of its class turned up): a try costs a comparison, not a rejected
verify nor a lookup, so the class follows the answer (a code edit's 2-3 token matches, 64-81% kept on quoting
answers, 17% on a free one: kept where the answer quotes, dropped where it does not) and a free answer runs no
verify at all.

Resting (`rest`, session 13): after a step without a draft, the drafter says how many of the next steps certainly
find no match worth a draft (a match grows by a token a step at most, `PromptLookup.quiet`); decode_together
takes those as plain steps without calling the speculator at all (`quiet`), and the next call counts them
(`wake`) and feeds the index their tokens in one call. A free answer then pays the speculator once in a few steps.
It rests those steps only (sessions 13-14 rested a few more each time a sequence declined, doubling up to 16 until a
verify: a code edit that reached 16 before its first quote rested through the quotes' starts and its shadow tries
came 16-32 steps late, 89 steps a turn instead of 76, 1.27x priced instead of 1.40x; whether that happened depended
on the turn's first steps, session 15).

Declining costs what the drafter's lookup costs: each class's best k is priced once and kept until a verify
runs or t(1) moves by more than REPRICE (`_priced_classes`), a drafter with match lengths is told the shortest
match that pays (`least_match`: it builds no draft after a shorter one), and a step in which no sequence drafts
is the plain step (engine/generate.py `plain_step`, its time observed). A lone sequence whose choice is settled
(`_settle`) takes its declining step from decode_together in one call (`decline`: the drafter asked, off's plain
step, a counter; one such step in TIME_EVERY timed): the Python of a step runs with the caches cold from the
forward, ~1-5 us a call, and the path through speculative_step, _propose, choose_k and the review cost ~30 us a
step more than off's (session 16's free answer: 0.995x). Where that is nothing (prompt lookup: `Drafter.free`) a
sequence never stops speculating: a free answer that later quotes its prompt (an explanation, then the edited
file) still drafts for the quote. A drafter with a cost of its own at k = 0 (a draft model catching up, an MTP
layer or a residency reading every forward's hidden states through the cache's sink, which keeps the model off
its fused plan) retires after `RETIRE_AFTER` steps in which the best k was expected to gain less than
`RETIRE_GAIN` over a plain step: the sequence goes back to the engine's own decode step. A model's drafts (class 0:
a draft model, MTP, a hybrid's model) are priced out only by a rejected verify that was not their first, and tried
once more before the drafter retires where its last verify kept one (session 17: a draft model's first verify is one
draft, and one rejection priced it out for the sequence, 0.7 -> 0.31, the 2-row verify's cost still the prior's; on
the paged code edit a draft model right at 24-42 of 28-48 positions ran 1.00 tokens a step). A drafter never kept
costs two rejected verifies, as many as before the retry. A model's drafts beside a lookup are tried by verifies
(the probe share's spacing), not in the shadow: they have none.

The step time is the cost model: on a paged model it includes reading the drafted tokens' experts that are
not resident, so speculation turns itself down where verifying costs more than it yields. With a `Residency`
(residency.py: a paged model, drafts copied from the sequence) the model knows more: the step time of r rows
includes the expert reads of a typical step of r rows (the misses per row count are measured too), and a
draft's own reads differ from that: its tokens' earlier routing predicts the experts the verify reads, of
which the pager holds some. For each draft prefix, the experts it adds to the pending token's (predicted the
same way) that are not resident, less the typical step's added misses, are priced at the measured stall per
missed expert (a verify's reads run in parallel, so a miss there costs what the measured steps say, not a
plain step's serial stall; an earlier model priced them serially and cut every draft). `fit` then keeps the
prefix of the draft with the most tokens per second under that model (a draft whose experts are resident is
cheaper than a typical one; one whose experts must be read is cut short or dropped), and has the
pager prefetch the experts the kept drafts predict.
"""

from __future__ import annotations

from dataclasses import dataclass

from localmoe.engine.spec.costs import StepCosts
from localmoe.engine.spec.drafters import Draft, Drafter

K_MAX = 7  # drafts per step: with the last token, 8 rows = the decode kernels' GEMV_MAX_ROWS
PROBE = 16  # the fewest plain steps between two tries while no draft pays
PROBE_MAX = 512  # the most (the spacing doubles with every try rejected)
PROBE_SHARE = 0.005  # the tries of a class that does not pay cost at most this share of the decode time
SMOOTH = 0.2  # weight of the newest measurement in the running averages
GAIN = 1.05  # a draft is verified where it is expected to beat a plain step by this much (step times are noisy)
REPRICE = 0.1  # the classes' best k are priced again once t(1) moved by more than this share (or a verify ran)
TIME_EVERY = 4  # a declining sequence times one plain step in this many (`times_plain`)
SETTLE = 8  # a declining sequence's choice of k is taken again at least this often (choose_k, `_settle`)
RETIRE_AFTER = 24  # steps without a worthwhile expected gain before a drafter with a cost at k = 0 stops
RETIRE_GAIN = 1.15  # expected tokens/s over a plain step below which such a drafter's cost is not worth it
# drafts by the length of the match they were copied from: 0 = none known (a draft model, MTP: the sequence's
# overall acceptance), 1, 2-3, 4-7, 8+ tokens; each class's prior a (weight PRIOR), until its own counts say. A
# single-token match is mostly a common word, not a quote (7% of such drafts kept on a free answer, the
# embedded model): its prior drafts only where a verify costs little more than a plain step. A 2-3 token match is
# kept 64-81% on quoting answers and 17% on a free one: its prior (0.3) does not pay for a verify even at the
# dense plan's first estimate (2 rows at costs.py's FIRST_ROWS_SAME), so a free answer verifies none at its prior (it did, two
# rejected verifies per answer) and a quoting one learns it from shadow tries (prompt lookup) within a few steps
CLASS_PRIOR = (None, 0.15, 0.3, 0.7, 0.9)
BUCKETS = len(CLASS_PRIOR)
PRIOR = 2.0


def bucket(draft: Draft) -> int:
    """A draft's confidence class: the length of the match it continues, in powers of two (0: no match known)."""
    return min(draft.match.bit_length(), BUCKETS - 1)


@dataclass(slots=True)
class SpecStats:
    steps: int = 0  # target forwards of this sequence while speculating (with or without drafts)
    drafted_steps: int = 0  # of those, steps that verified at least one draft
    drafted: int = 0  # tokens drafted and verified
    accepted: int = 0  # drafted tokens kept
    emitted: int = 0  # tokens the steps yielded (kept drafts + the target's own token of each step)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.emitted / self.steps if self.steps else 0.0

    def add(self, other: SpecStats) -> None:
        for name in self.__slots__:
            setattr(self, name, getattr(self, name) + getattr(other, name))

    def to_dict(self) -> dict:
        return {"steps": self.steps, "drafted": self.drafted, "accepted": self.accepted, "emitted": self.emitted,
                "acceptance": round(self.acceptance, 4), "tokens_per_step": round(self.tokens_per_step, 3)}


class Speculator:
    """Drafts for one sequence and learns how many pay (see the module docstring). `adaptive=False`
    always drafts up to `k` (tests, benchmarks of a fixed k)."""

    # attributes in fixed slots, the ones a declining step reads first (a plain instance dict of ~50 keys is a hash
    # table whose entries a step's reads find cold after the forward); `__dict__` keeps others settable (tests)
    __slots__ = ("stats", "_fast_until", "_fast_k", "_fast_least", "least", "untimed", "quiet", "_quiet_set",
                 "_quiet_of", "hopeless", "drafter", "clock", "costs", "alone", "retired", "free", "deterministic",
                 "matches", "follows", "residency", "k_max", "adaptive", "_memo", "_review_at", "_kept", "_trials",
                 "_bucket_kept", "_bucket_trials", "_more_kept", "_more_trials", "_verified", "draft_seconds",
                 "_catches_up", "_drafts_timed", "step_misses", "miss_seconds", "_counters", "_tried", "_probing",
                 "_backoff", "rows_plain", "_memo_costs", "_memo_t1", "_spacing", "_choice", "_worth", "_least",
                 "_classes", "_poor", "shadow_tries", "shadow_kept", "looked", "__dict__", "__weakref__")

    def __init__(self, drafter: Drafter, k: int = 4, adaptive: bool = True, residency=None):
        if not 1 <= k <= K_MAX:
            raise ValueError(f"speculation drafts 1..{K_MAX} tokens per step, not {k}")
        self.drafter, self.k_max, self.adaptive, self.residency = drafter, k, adaptive, residency
        self.stats = SpecStats()
        self._kept, self._trials = 0.7, 1.0  # decayed counts: drafts kept, positions tried (prior a = 0.7)
        self._again = True  # class 0 is tried once more (`_measuring`; before the drafter retires, `choose_k`): its
        # last verify kept one, or it was its first
        # per bucket(): decayed counts of its drafts' first token kept, tries; of a further token kept once the one
        # before it was, positions reached (`_tally`)
        self._bucket_kept, self._bucket_trials = [0.0] * BUCKETS, [0.0] * BUCKETS
        self._more_kept, self._more_trials = [0.0] * BUCKETS, [0.0] * BUCKETS
        self._verified = False  # this sequence ran a verify (`_measuring`)
        self.draft_seconds = 0.0  # the drafter's time per token it runs (a draft model's forwards; first replaced)
        self._catches_up = float(hasattr(drafter, "caught_up"))  # a drafter with a cache runs the yielded tokens too
        self._drafts_timed = 0
        # with a residency: rows -> average expert misses of a step; the stall per expert missed; the pager's
        # (stall, misses) when this step began
        self.step_misses: dict[int, float] = {}
        self.miss_seconds: float | None = None
        self._counters: tuple[float, int] | None = None
        self._tried = [0] * BUCKETS  # the step (stats.steps) of each class's last verify
        self._probing = False  # the step being verified tries a draft its class does not pay for
        self._backoff = [1] * BUCKETS  # the spacing of a class's tries, times this (doubled by every try rejected)
        # declining costs nothing but the drafter's lookup: never retire (a residency reads every forward)
        self.free = getattr(drafter, "free", False) and residency is None
        self.rows_plain: bool | None = None  # the plain steps are the row kernels' too (the caller sets it once)
        # t(1) and t(r) / t(1) on this model: its own until the caller (verify.py) gives it the model's shared one
        self.costs = StepCosts()
        self.clock = None  # what steps are timed with (the caller sets it once: verify.py step_clock)
        self._memo: list[tuple[int, float]] | None = None  # each class's _best, priced at t(1) = _memo_t1
        self._memo_costs: list[float] = []  # the t(r) it was priced with
        self._memo_t1 = 0.0
        # what the memo says: plain steps between two tries while no draft pays (times _backoff), the best k
        # over the classes, whether the classes seen gain enough (retirement), the shortest match that pays
        self._spacing, self._choice, self._worth, self._least = float(PROBE), 0, True, 1
        self._classes = range(BUCKETS)  # the classes drafts may come in
        self._poor = 0  # consecutive choices whose expected gain was below RETIRE_GAIN
        self.retired = False  # speculation stopped for this sequence (see the module docstring)
        self.matches = getattr(drafter, "matches", False)  # its drafts carry their match length (`least` applies)
        # its drafts come from a lookup (classes 1..4) or, where it has no long match, a model (class 0: hybrid.py)
        self.mixed = self.matches and getattr(drafter, "mixed", False)
        # (length of the history, least) -> True where no draft of `least` keys can be there (checked before a call)
        self.hopeless = getattr(drafter, "hopeless", None) if self.matches else None
        self.least = 1  # `least_match()` of this step, set by `choose_k` where the drafter has match lengths
        # its drafts depend on the history alone: classes that do not pay are tried in the shadow (`_review`)
        self.deterministic = self.matches and getattr(drafter, "deterministic", False) and hasattr(drafter, "shadow")
        self._review_at = -1  # the drafter's next key to look at for shadow tries (`_review`; -1: not yet, the
        # prompt's keys are not the answer's)
        self.shadow_tries = self.shadow_kept = 0  # shadow tries resolved, and of those, the ones with a token kept
        # steps the sequence takes without the speculator (decode_together's plain step): none of them could draft
        # (`rest`); `_quiet_set` what was granted, the steps it skipped are counted when it runs again (`wake`)
        self.quiet = self._quiet_set = 0
        self._quiet_of = getattr(drafter, "quiet", None) if self.deterministic and adaptive else None
        self._fast_until, self._fast_k, self._fast_least = 0.0, 0, 1  # `_settle`'s
        self.untimed = 0  # declined steps still to take before one is timed (`decline`, `times_plain`)
        self.looked: Draft | None = None  # the draft `decline` got this step, for the full step (verify.py `_propose`)
        self.alone = False  # set up for a lone sequence's step (verify.py: its clock and costs known, no cache watched)
        # a drafter working beside the steps (a draft model's thread, draft_model.py): it catches up on the prompt and,
        # far behind, on steps without a draft (`follow`); verify.py's clock leaves its thread's CPU out
        self.follows = hasattr(drafter, "follow") and getattr(drafter, "ahead", False)

    @property
    def acceptance(self) -> float:
        """The estimated chance that the target keeps a draft given it kept the ones before (a)."""
        return self._kept / self._trials

    def bucket_acceptance(self, b: int) -> tuple[float, float]:
        """(p, c) for drafts of confidence class `b` (bucket()): the chance that the first draft is kept, and that a
        further one is once the one before it was, each from its own counts and the class's prior (class 0: both
        `acceptance`). Two numbers, not one a: a class's drafts are mostly all right or wrong at once (a single-token
        match is either a quote's start or a common word: on the code edit the first of such drafts is kept 31%,
        a further one 53%; one a of 0.39 overrated its first draft and verified it at a loss)."""
        if b == 0:
            return self.acceptance, self.acceptance
        prior = PRIOR * CLASS_PRIOR[b]
        return ((self._bucket_kept[b] + prior) / (self._bucket_trials[b] + PRIOR),
                (self._more_kept[b] + prior) / (self._more_trials[b] + PRIOR))

    def _tally(self, b: int, kept: int, n: int) -> None:
        """Class b's counts after a try of n drafts of which the first `kept` were kept (a verify or in the shadow):
        its first draft, and the further ones it reached."""
        self._bucket_kept[b] = (1 - SMOOTH) * self._bucket_kept[b] + (kept > 0)
        self._bucket_trials[b] = (1 - SMOOTH) * self._bucket_trials[b] + 1
        if kept and n > 1:
            self._more_kept[b] = (1 - SMOOTH) * self._more_kept[b] + kept - 1
            self._more_trials[b] = (1 - SMOOTH) * self._more_trials[b] + kept - 1 + (kept < n)

    def _costs(self) -> list[float]:
        """t(r) for r = 1 .. k_max + 1 (`_estimate`), taken once for every class a pricing pass prices."""
        return [self._estimate(r) for r in range(1, self.k_max + 2)]

    def _best(self, a: tuple[float, float], costs: list[float] | None = None) -> tuple[int, float]:
        """(the k with the most expected tokens per second at acceptance a = (p, c), `bucket_acceptance`, that rate);
        k = 0: a plain step. `costs`: `_costs()` (taken here where not given)."""
        costs = costs or self._costs()
        best, best_rate = 0, GAIN / costs[0]
        tokens, further, c = 1.0, a[0], a[1]  # `_expected` term by term (a free answer reprices at most steps)
        catch, per = self._catches_up, self.draft_seconds
        for k in range(1, self.k_max + 1):
            tokens += further  # a draft model then also runs the tokens the step yields
            further *= c
            rate = tokens / (costs[k] + (k + tokens * catch) * per)
            if rate > best_rate:
                best, best_rate = k, rate
        return best, best_rate

    @property
    def watches(self) -> bool:
        """Whether it reads the target's forwards through the cache's `hidden_sink` (`watch`)."""
        return hasattr(self.drafter, "watch") or self.residency is not None

    def watch(self, cache, prompt=()) -> None:
        """The sequence's cache (a new one after a preemption): a drafter that reads the target's hidden
        states (MTP) watches it, else the residency files the routing of the positions it runs. A drafter that
        follows the sequence in a thread starts on its `prompt` beside the target's prefill."""
        if self.follows and prompt:
            self.drafter.follow(prompt)
        if hasattr(self.drafter, "watch"):
            self.drafter.watch(cache)
        elif self.residency is not None:
            self.residency.watch(cache)

    def choose_k(self) -> int:
        """The most drafts to ask the drafter for this step (`fit` cuts the draft to what its confidence class pays);
        sets `least` (`least_match()`) for a drafter with match lengths."""
        reviewed = self.deterministic and self._memo is not None
        if reviewed:
            self._review()  # (the keys indexed since the last step: a few)
        if self.stats.steps < self._fast_until:  # nothing changed since the last full pass (`_settle`)
            self.least = self._fast_least
            return self._fast_k
        self.least = 1
        if self.residency is not None:
            self._counters = self.residency.counters()
        if not self.adaptive:
            return self.k_max
        if self.costs.t1() is None:  # a plain step's cost is the yardstick: measure one first
            return 0
        if self._measuring():
            return 1
        self._priced_classes()
        if self.deterministic and not reviewed:
            self._review()
        best = self._choice
        if not self.free:
            self._poor = 0 if self._worth else self._poor + 1
            if self._poor >= RETIRE_AFTER:
                if self._again and (self.mixed or not self.matches) and not self._memo[0][0]:
                    # a model's drafts (class 0) priced out by its first verify or a kept one: tried once more first
                    # (module docstring: one rejected first verify priced it out for the sequence, session 17)
                    self._tried[0] = self.stats.steps - PROBE_MAX  # (due: `_due`)
                    self._poor, best = 0, best or 1  # (the count starts afresh: the try may price it in)
                else:
                    self.retired = True
                    if self.residency is not None:
                        self.residency.unwatch()  # the model's own step again (a sink keeps it on the rows)
        if self.matches:
            self.least = self._least_due()
        if best == 0 and not self.deterministic and any(self._due(b) for b in self._classes):
            return 1  # a try is due: one draft (`fit` keeps it if its class is the one due)
        if self.free and self.matches:
            self._settle(best)
        return best

    def _settle(self, best: int) -> None:
        """Let the next steps skip choose_k's pricing while nothing it depends on changes: until the first step at
        which a class's try falls due (`_due`), SETTLE steps at most (t(1) is checked for REPRICE that often), and
        not past a verify or a verify's row count measured (`observe` ends it). Declining costs a few attribute
        reads then (choose_k runs on every step of a speculating sequence)."""
        if self.deterministic:  # tries are found after the fact (`_review`, every call): only t(1) is watched, every
            # SETTLE calls
            self._fast_until = self.stats.steps + SETTLE
            self._fast_k, self._fast_least = best, self.least
            return
        most = PROBE_MAX
        # a class that pays is never due (its drafts are verified: counting it made every step a full pass on a
        # free answer); one due already is in `least` until its try starts (`fit` ends the window) or, tried after
        # the fact, waits for a key of its class (`_review`, once a window), so only those due later count
        now = self.stats.steps
        due = min((t for b in range(1, BUCKETS) if not self._memo[b][0]
                 for t in (self._tried[b] + min(self._spacing * self._backoff[b], most),) if t > now + 1e-6),
                default=float("inf"))
        self._fast_until = min(due - 1e-6, self.stats.steps + SETTLE)
        self._fast_k, self._fast_least = best, self.least

    def _priced_classes(self) -> list[tuple[int, float]]:
        """`_best` of each confidence class (bucket()), priced again only once a verify ran (acceptance, row
        times) or t(1) moved by more than REPRICE: a sequence that declines step after step prices nothing."""
        one = self.costs.t1()
        if self._memo is None or abs(one - self._memo_t1) > REPRICE * self._memo_t1:
            self._memo_costs = costs = self._costs()  # (the same for every class: a pass after each verify priced
            # them 5 times; a shadow try that settles reprices its class with them)
            self._memo = [self._best(self.bucket_acceptance(b), costs) for b in range(BUCKETS)]
            self._memo_t1 = one
            # a try costs a 2-row verify over a plain step, and making its draft (a shadow try: the lookup)
            self._spacing = max(PROBE, (self._estimate(2) - one + self.draft_seconds) / one / PROBE_SHARE)
            self._chosen()
        return self._memo

    def _chosen(self) -> None:
        """What the memo says (the best k over the classes, whether they gain enough, the least class that pays)."""
        priced, one = self._memo, self._memo_t1
        seen = [b for b in range(1, BUCKETS) if self._bucket_trials[b] > 0] + [0] * self.mixed
        # a drafter whose drafts carry their match length: every class, the unseen ones at their prior (class 0 too
        # where a model drafts beside the lookup)
        self._classes = classes = range(0 if self.mixed else 1, BUCKETS) if seen or self.matches else [0]
        self._choice = max((priced[b] for b in classes), key=lambda kr: kr[1])[0]
        # whether the classes seen so far gain enough to keep a drafter that costs something at k = 0
        self._worth = max(priced[b][1] for b in (seen or [0])) >= RETIRE_GAIN / one
        self._least = next((b for b in range(1, BUCKETS) if priced[b][0]), BUCKETS)  # the least class that pays

    def least_match(self) -> int:
        """The shortest match whose draft `fit` may keep: a drafter with match lengths (`Drafter.matches`) need
        not build the drafts of shorter ones. 1 where every draft may be kept (not adaptive, not priced yet, a
        try due, a residency pricing drafts by their reads)."""
        if not self.adaptive or self.residency is not None or self.costs.t1() is None:
            return 1
        self._priced_classes()
        return self._least_due()

    def _least_due(self) -> int:
        """`least_match` once the classes are priced."""
        if self.residency is not None:
            return 1
        least = self._least
        if self.deterministic:  # a class due for a try is tried after the fact (`_review`): no lookup for it
            return 1 << (least - 1)
        since, most = self.stats.steps, PROBE_MAX
        for b in range(1, least):  # a class due for a try (`_due`, inlined: this runs every step)
            if since - self._tried[b] >= min(self._spacing * self._backoff[b], most) - 1e-6:
                least = b
                break
        return 1 << (least - 1)  # bucket() b holds matches of 2^(b-1) tokens and more

    def _measuring(self) -> bool:
        """A drafter without match lengths (a draft model, MTP) and no verify measured yet, or only its first, whose
        draft was rejected: its first drafts (one a step) measure a verify. Its acceptance is unknown until tried (no
        class says how likely a draft is kept; one rejection alone is not a measure of it: session 17), and it
        retires where drafting does not pay."""
        return not self.matches and (not self._verified or self._again and not self._bucket_kept[0])

    def _due(self, b: int) -> bool:
        """Whether the steps since class b's last verify call for a try of it (see the module docstring)."""
        since = self.stats.steps - self._tried[b]
        return since >= min(self._spacing * self._backoff[b], PROBE_MAX) - 1e-6  # (float spacing)

    def _priced(self) -> bool:
        """Whether the residency cost model has what it needs (a plain step's misses and a missed expert's stall)."""
        return self.residency is not None and 1 in self.step_misses and self.miss_seconds is not None

    def _estimate(self, rows: int) -> float:
        """Seconds of a step of `rows` rows (with its typical expert reads; `fit` prices a draft's own): the model's
        t(1) times its t(rows) / t(1) (costs.py; t(1) is measured first)."""
        return self.costs.t1() * self.costs.ratio(rows)

    def fit(self, draft: Draft, at: int | None = None) -> Draft:
        """The prefix of `draft` worth verifying: as many drafts as pay at the acceptance of its confidence class
        (bucket()), and with a residency, given the reads its predicted experts add (see the module docstring),
        the pager asked to prefetch them. `at`: the position of the draft's first token (unused since shadow tries
        are made after the fact, `_review`)."""
        self._probing = False
        if not draft.tokens or not self.adaptive or self.costs.t1() is None or self._measuring():
            return self._priced_fit(draft, None)
        b = bucket(draft)
        a = self.bucket_acceptance(b)
        keep = self._priced_classes()[b][0]
        if keep == 0 and self.deterministic and b:  # tried in the shadow after the fact (`_review`), never by a
            return draft.first(0)  # verify (a model's draft beside a lookup, class 0, is tried by a verify)
        if keep == 0:  # a draft its class does not pay for: now and then one is tried anyway
            self._probing = self._due(b)
            keep = int(self._probing)
        return self._priced_fit(draft.first(keep), a)

    def _priced_fit(self, draft: Draft, a: tuple[float, float] | None) -> Draft:
        r = self.residency
        if r is None or draft.source is None or not draft.tokens:
            return draft
        # the pending token matched the n-gram before the copied span: its experts are those at source - 1, and
        # a plain step reads what of them is missing (priced in plain_stall); the drafts add what their union adds
        keys = r.predicted(draft.source - 1, len(draft.tokens) + 1)
        keep = len(draft.tokens)
        if a is not None and self._priced():
            missing = r.missing(keys)
            keep, best = 0, GAIN / self._estimate(1)
            measured = max(self.step_misses)
            for j in range(1, len(draft.tokens) + 1):
                # the reads a draft adds over a typical step of as many rows (whose time includes its reads); where
                # no step of j + 1 rows or more was measured yet, none: that typical step's misses are not known (an
                # estimate of 0 added misses priced every predicted one at a stall and cut every draft, long quotes'
                # included, so no verify ever measured them: 0-10% of the document task's drafts verified)
                typical = _interpolate(self.step_misses, j + 1) - self.step_misses[1]
                added = (missing[j] - missing[0] - typical) * self.miss_seconds if measured >= j + 1 else 0.0
                tokens = _expected(a, j)
                cost = max(self._estimate(j + 1) + added, self._estimate(1)) + j * self.draft_seconds
                rate = tokens / cost
                if rate > best:
                    keep, best = j, rate
        if keep:
            r.prefetch(keys[1:keep + 1])
        return draft.first(keep)

    def _review(self) -> None:
        """Shadow tries after the fact (a deterministic drafter, `shadow`): every key indexed since the last look whose
        match is of a class that does not pay, once the keys after it decide its draft's fate, counts as a verify of
        that draft would. Runs in choose_k, over the keys the index took since: a class that does not pay costs no
        lookup of its own (the index takes the tokens when the paying classes need it), and learns from every draft
        it would have had, so it follows the answer (a quote's short matches are kept, a free answer's are not)."""
        drafter, memo, at = self.drafter, self._memo, self._review_at
        lengths, end = drafter._mlen, len(drafter._mlen)
        if at < 0 or at > end:  # the first look (from the answer's keys on), or the index started afresh
            self._review_at = end or -1  # (-1: nothing indexed yet, the prompt's keys come with the first lookup)
            return
        if at == end:
            return
        k, before = self.k_max, {}
        while at < end:
            b = min(lengths[at].bit_length(), BUCKETS - 1)
            if b and not memo[b][0]:
                fate = drafter.shadow(at, k)
                if fate is None:  # decided by keys still to come: looked at again then
                    break
                kept, n = fate
                self.shadow_tries += 1
                self.shadow_kept += kept > 0
                if b not in before:
                    before[b] = self.bucket_acceptance(b)
                self._tally(b, kept, n)
            at += 1
        self._review_at = at
        # the classes tried whose p or c rose: priced again (only they, with the memo's t(r)), once a look. A class's
        # tokens per second rise with p and c, so one that did not pay and whose p and c did not rise still does not,
        # and its memo entry (k 0, a plain step's rate) stands: a free answer's tries, mostly rejected, price nothing
        rose = [b for b, (p, c) in before.items() for q, d in (self.bucket_acceptance(b),) if q > p or d > c]
        if rose:
            self._reprice(rose)

    def _reprice(self, classes) -> None:
        choice, least = self._choice, self._least
        for b in classes:
            self._memo[b] = self._best(self.bucket_acceptance(b), self._memo_costs)
        self._chosen()
        if (self._choice, self._least) != (choice, least):
            self._fast_until = 0.0  # the settled choice changed

    def settle_shadow(self, b: int, kept: int, n: int) -> None:
        """One shadow try of class b: `kept` of its `n` drafts would have been kept (module docstring)."""
        self.shadow_tries += 1
        self.shadow_kept += kept > 0
        self._tally(b, kept, n)
        if self._memo is not None:
            self._reprice([b])

    def rest(self, length: int) -> None:
        """After a step that did not draft, the history `length` tokens: grant the next steps that certainly find
        no match worth a draft (`least`; the drafter's `quiet`) to decode_together's plain step, without this
        speculator (a free answer's steps then cost what `--spec off`'s do)."""
        if self._quiet_of is not None and self.least > 1:
            self.quiet = self._quiet_set = self._quiet_of(length, self.least)

    def wake(self) -> None:
        """Count the steps taken without it since `rest` (plain steps: a token each)."""
        skipped = self._quiet_set - self.quiet
        self.stats.steps += skipped
        self.stats.emitted += skipped
        self.quiet = self._quiet_set = 0

    @property
    def times_plain(self) -> bool:
        """Whether the next declined step is timed (`decline`): one in TIME_EVERY once the model's t(1) is known
        (its median over the last plain steps moves slowly; the first clock reading after a forward is a system call
        with cold caches, ~10 us)."""
        return not self.untimed

    def decline(self, dec, step, fused: bool, look: bool = True) -> list | None:
        """A lone sequence's step without a draft: `step((dec,), fused)`, off's plain step, counted; one such step in
        TIME_EVERY timed for the model's t(1) (`times_plain`); then the next steps that certainly find no draft are
        left to decode_together (`rest`) -> the step's results. `look` (decode_together, before the speculative step):
        only where the choice is settled (`_settle`: a free drafter with match lengths, its k and `least` fixed for
        the next steps) and the drafter has no draft (its `hopeless`, else a lookup); None otherwise (not settled, a
        replay, a draft: the full step, verify.py, proposes again: a free drafter's propose is a lookup). Without
        `look` (verify.py, after `_propose` found nothing) it only takes the step.

        The settled window skips choose_k and the shadow tries' review (`_review`, run by the next full pass, at
        most SETTLE steps later: a class a try prices in drafts that much later). What `observe` does for a plain
        step, less its branches (a lone sequence has no residency: it would watch the cache), in one call: each call
        and line here runs with the caches cold from the forward, and a declining step through speculative_step,
        _propose, choose_k and the review cost ~30 us more than off's (session 16: 0.995x on a free answer)."""
        if look:
            if self._quiet_set:  # (the steps it rested count towards the settled window)
                self.wake()
            if self.stats.steps >= self._fast_until or dec._replay:
                return None
            self.least = least = self._fast_least
            k = self._fast_k
            if k > 0:
                history, pending = dec.in_cache, dec.pending
                hopeless = self.hopeless
                if hopeless is None or not hopeless(len(history) + len(pending), least):
                    history.extend(pending)
                    try:
                        draft = self.drafter.propose(history, k, dec.params, dec.generator, least=least)
                    finally:
                        del history[len(history) - len(pending):]
                    if draft.tokens:  # the full step's: a drafter whose draft is not a function of the history alone
                        if not self.deterministic:  # is not asked twice in a step (`looked`, verify.py `_propose`)
                            self.looked = draft
                        return None
        if self.untimed:
            self.untimed -= 1
            results = step((dec,), fused)
        else:
            clock = self.clock
            began = clock()
            results = step((dec,), fused)
            costs = self.costs
            costs.plain(clock() - began)
            self.untimed = TIME_EVERY - 1 if costs.t1() is not None else 0
        s = self.stats
        s.steps += 1
        s.emitted += 1
        if self._quiet_of is not None and self.least > 1:
            self.quiet = self._quiet_set = self._quiet_of(len(dec.in_cache), self.least)
        return results

    def observe(self, drafted: int, accepted: int, rows: int, seconds: float | None, confidence: int = 0,
                drafting: float = 0.0) -> None:
        """Account one step: `drafted` drafts verified (of class `confidence`, bucket()), `accepted` kept, `rows`
        rows run in `seconds` (the forward), the drafts made in `drafting` seconds."""
        s = self.stats
        s.steps += 1
        s.emitted += accepted + 1
        if not drafted and rows == 1 and self.residency is None:
            self._probing = False  # a plain step (the common one where no draft pays): t(1) only, nothing else
            if seconds is not None:  # (None: not timed, `times_plain`)
                self.costs.plain(seconds)
            return
        if drafted:
            self._tried[confidence] = s.steps
            if self._probing:  # a try of a class that did not pay: rejected, the next waits twice as long
                self._backoff[confidence] = 1 if accepted else min(2 * self._backoff[confidence], PROBE_MAX)
        self._probing = False
        if drafted or rows > 1:
            self._memo = None  # the acceptance or a verify's time changed: price the classes again
            self._fast_until = 0.0
        if drafted:
            s.drafted_steps += 1
            s.drafted += drafted
            s.accepted += accepted
            if confidence == 0:  # class 0's acceptance (a model's drafts; a lookup's are counted by class below)
                # each kept draft is a success; the first rejected one (if any) the one failure of the step
                self._kept = (1 - SMOOTH) * self._kept + accepted
                self._trials = (1 - SMOOTH) * self._trials + accepted + (accepted < drafted)
                self._again = accepted > 0 or not self._bucket_trials[0]  # (tallied below)
            self._drafts_timed += 1
            per = drafting / (drafted + getattr(self.drafter, "caught_up", 0))  # a draft model's tokens run: the
            # sequence's new ones (the prompt, the first time) and the drafts
            self.draft_seconds = per if self._drafts_timed <= 2 else self.draft_seconds + SMOOTH * (per - self.draft_seconds)
            self._tally(confidence, accepted, drafted)
        if rows == 1:  # (a residency's plain step: its misses below)
            if seconds is not None:
                self.costs.plain(seconds)
        else:  # a sample of the model's t(rows) / t(1) (the table drops each row count's first use)
            self._verified = True
            self.costs.verify(rows, seconds)
        if self.residency is not None and self._counters is not None:
            stall, misses = self.residency.counters()
            stall, misses = stall - self._counters[0], misses - self._counters[1]
            _average(self.step_misses, rows, misses)
            if misses:
                per = stall / misses
                self.miss_seconds = per if self.miss_seconds is None else self.miss_seconds + SMOOTH * (per - self.miss_seconds)


def _expected(a: tuple[float, float], k: int) -> float:
    """Tokens a step of k drafts yields on average at acceptance a = (p, c) (`bucket_acceptance`): its own token,
    the first draft with chance p, each further one with chance c once the one before it was kept."""
    p, c = a[0], min(a[1], 0.999)
    return 1 + p * (1 - c ** k) / (1 - c)


def _average(table: dict[int, float], rows: int, value: float) -> None:
    old = table.get(rows)
    table[rows] = value if old is None else old + SMOOTH * (value - old)


def _interpolate(table: dict[int, float], rows: int) -> float:
    """table[rows] when measured, else linear between (or beyond) the nearest measured row counts."""
    if rows in table:
        return table[rows]
    known = sorted(table)
    below = max((r for r in known if r < rows), default=known[0])
    above = min((r for r in known if r > rows), default=None)
    if above is None:  # extrapolate with the slope of the two largest measured
        lo, hi = (known[-2], known[-1]) if len(known) > 1 else (known[0], known[0])
        slope = (table[hi] - table[lo]) / (hi - lo) if hi > lo else 0.0
        return table[below] + max(slope, 0.0) * (rows - below)
    t0, t1 = table[below], table[above]
    return t0 + (t1 - t0) * (rows - below) / (above - below)
