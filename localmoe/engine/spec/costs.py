"""What a verify of r rows costs against a plain step, for one model: t(r) / t(1), shared by its sequences.

A speculator chooses k by acceptance x cost: E(k) tokens (speculator.py) for t(k + 1). Measured per sequence
(the median of a row count's last 9 steps, session 8-13), t(r) / t(1) read on a loaded host anywhere from 1.0 to
1.7 for a 2-row verify within one code-edit turn (the true figure ~1.2) and the choice of k followed that noise: a
5-row verify priced at 1.24 plain steps drafted after single-token matches at k = 4, one priced at 2.3 cut 93%-kept
quotes to 2. The cost of r rows is a property of the model's plan, not of the sequence, so it is learned once per
model (and per kind of plain step and clock: `shared`) from every sequence's steps: each verify's time over the
plain steps' median at the time (a ratio: the load moves both) is a sample of its row count, and the curve is the
median of each row count's last WINDOW samples (a verify preempted under load is one sample in WINDOW), blended with
the prior while a row count has fewer than TRUSTED, non-decreasing in r and at least 1 (a verify computes more than a plain
step). A sequence's k then follows its acceptance. The absolute scale (a draft model's own time per token and a
missed expert's stall are priced against it) is t(1) here too, the median of the model's last PLAIN plain steps: this
table is the one place step times are kept, and its first-use rule the only one (the first step of each row count on
the model, plain steps included, pays its kernels' first use and is not a sample; sessions 13-14 also kept each
sequence's medians of every row count and dropped their first steps per sequence, of which pricing read only t(1)).
"""

from __future__ import annotations

import weakref
from collections import deque

WINDOW = 64  # samples per row count kept: the curve is their median
PLAIN = 33  # plain step times kept: t(1) is their median (normalises each verify's sample)
PRIOR_WEIGHT = 1.0  # the prior counts as this many samples of a row count with fewer than TRUSTED
TRUSTED = 4  # from this many samples on, a row count's median alone
FIRST_ROWS = 2.0  # before any verify is measured: t(2) / t(1) (pessimistic: the row kernels against a fused step)
FIRST_ROWS_SAME = 1.3  # the same where the plain step is the row kernels' (`rows_plain`)
ROW_SLOPE = 0.25  # each row past the largest measured adds this share of it (one row count measured), or the prior's


class StepCosts:
    """t(r) / t(1) of one model's steps (see the module docstring). `rows_plain`: the plain step is the row kernels'
    too (batched, or a fused plan that runs both), so the prior is FIRST_ROWS_SAME, else FIRST_ROWS."""

    def __init__(self, rows_plain: bool | None = None):
        self.rows_plain = rows_plain
        self._plain: deque = deque(maxlen=PLAIN)
        self._t1: float | None = None  # the median of _plain (None: taken again when read)
        self._samples: dict[int, deque] = {}  # rows -> the last WINDOW ratios
        self._first: set[int] = set()  # row counts whose first step (its kernels' first use) was dropped (1: plain)
        self._curve: list[float] | None = None  # ratio by rows (index r), None: computed again when read

    def plain(self, seconds: float) -> None:
        """A plain step's time (none <= 0: a pager's counters reset under the clock, `verify.step_clock`); the first
        on the model is dropped (`_first_use`)."""
        if seconds <= 0 or self._first_use(1):
            return
        self._plain.append(seconds)
        self._t1 = None

    def _first_use(self, rows: int) -> bool:
        """Whether this is the model's first step of `rows` rows (its kernels' first use: not a sample)."""
        if rows in self._first:
            return False
        self._first.add(rows)
        return True

    def t1(self) -> float | None:
        """The median of the recent plain steps (None before any)."""
        if self._t1 is None and self._plain:
            s = sorted(self._plain)
            self._t1 = s[len(s) // 2]
        return self._t1

    def verify(self, rows: int, seconds: float) -> None:
        """A step of `rows` rows took `seconds` (its forward and its acceptance). The first of each row count is
        dropped (`_first_use`); without a plain step measured yet it cannot be a ratio."""
        one = self.t1()
        if rows < 2 or not one or seconds <= 0 or self._first_use(rows):
            return
        self._samples.setdefault(rows, deque(maxlen=WINDOW)).append(seconds / one)
        self._curve = None

    def measured(self, rows: int) -> int:
        """Samples of a row count."""
        return len(self._samples.get(rows, ()))

    def prior(self, rows: int) -> float:
        return (FIRST_ROWS_SAME if self.rows_plain else FIRST_ROWS) * (1 + ROW_SLOPE * (rows - 2))

    def ratio(self, rows: int) -> float:
        """t(rows) / t(1)."""
        if rows <= 1:
            return 1.0
        curve = self._curve
        if curve is None or rows >= len(curve):
            curve = self._curve = self._fit(max(rows, 9))
        return curve[rows]

    def _fit(self, most: int) -> list[float]:
        """The curve for 0..most rows (module docstring): each measured row count's median blended with the prior
        by their counts, the others between their measured neighbours (from 1.0 at one row) or past the largest with
        the slope of the two largest (ROW_SLOPE of the largest where one is measured), non-decreasing, >= 1."""
        known = {}
        for r, samples in self._samples.items():
            if samples and r <= most:
                s = sorted(samples)
                n = len(s)
                known[r] = s[n // 2] if n >= TRUSTED else (n * s[n // 2] + PRIOR_WEIGHT * self.prior(r)) / (n + PRIOR_WEIGHT)
        rows = sorted(known)
        curve = [1.0, 1.0]
        for r in range(2, most + 1):
            if not rows:
                v = self.prior(r)
            elif r in known:
                v = known[r]
            elif r < rows[-1]:
                below = max((q for q in rows if q < r), default=1)
                above = min(q for q in rows if q > r)
                lo = 1.0 if below == 1 else known[below]
                v = lo + (known[above] - lo) * (r - below) / (above - below)
            elif len(rows) > 1:
                hi, lo = rows[-1], rows[-2]
                v = known[hi] + max(known[hi] - known[lo], 0.0) / (hi - lo) * (r - hi)
            else:
                v = known[rows[-1]] * (1 + ROW_SLOPE * (r - rows[-1]))
            curve.append(max(v, curve[-1]))
        return curve


_SHARED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {(fused, clock): StepCosts}


def shared(model, fused: bool, rows_plain: bool, clock) -> StepCosts:
    """The model's step costs for plain steps of this kind (`fused`: the model's fused single-token step) timed by
    this clock, shared by every sequence that speculates on it."""
    per = _SHARED.setdefault(model, {})
    key = (fused, rows_plain, getattr(clock, "__name__", id(clock)))
    if key not in per:
        per[key] = StepCosts(rows_plain)
    return per[key]
