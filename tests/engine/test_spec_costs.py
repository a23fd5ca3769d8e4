"""The model's step costs (engine/spec/costs.py): t(r) / t(1) learned from every sequence's steps, robust to a few
noisy samples, non-decreasing in r, shared per model and kind of plain step; a sequence's k then follows its
acceptance, not its own few verifies' times."""

from __future__ import annotations

import random
import time

from localmoe.engine.spec import costs
from localmoe.engine.spec.costs import TRUSTED, StepCosts
from localmoe.engine.spec.drafters import Draft, PromptLookup
from localmoe.engine.spec.speculator import Speculator, bucket


def _calibrated(slope: float = 0.22, samples: int = 30) -> StepCosts:
    table = StepCosts(rows_plain=True)
    rnd = random.Random(0)
    for _ in range(20):
        table.plain(1.0)
    for r in range(2, 9):
        for _ in range(samples + 1):  # (the first of each row count is dropped: its kernels' first use)
            table.verify(r, (1 + slope * (r - 1)) * rnd.uniform(0.95, 1.05))
    return table


def test_the_curve_is_each_row_counts_median_non_decreasing_and_the_prior_until_measured():
    table = StepCosts(rows_plain=True)
    assert table.ratio(1) == 1.0 and table.ratio(3) == table.prior(3)  # nothing measured: the prior
    table.verify(5, 1.0)  # no plain step yet: no ratio to take
    table.plain(-3.0)  # a clock whose counters were reset during the step: no sample
    assert table.measured(5) == 0 and table.t1() is None
    for _ in range(9):
        table.plain(1.0)
    table.plain(40.0)  # a preempted plain step: one of many
    table.verify(5, 9.0)  # a row count's first step (its kernels' first use): dropped
    assert table.measured(5) == 0 and table.ratio(5) == table.prior(5)
    for seconds in (1.8, 1.9, 2.0) * 10 + (6.0, 0.2, 7.5, -5.0):  # three outliers among 33, a reset clock's
        table.verify(5, seconds)
    assert table.ratio(5) == 1.9
    table.verify(3, 9.9)
    for seconds in (1.3, 1.3, 1.4) * 3:
        table.verify(3, seconds)
    assert table.ratio(3) == 1.3
    assert 1.3 < table.ratio(4) < 1.9  # between its measured neighbours
    assert 1.0 < table.ratio(2) < 1.3 and table.ratio(7) > table.ratio(6) > 1.9  # from 1.0 at one row; past 5
    for _ in range(TRUSTED + 1):
        table.verify(6, 1.5)  # cheaper than 5 rows (noise): the curve does not fall
    assert table.ratio(6) == table.ratio(5) == 1.9


def test_a_few_rows_measured_blend_with_the_prior():
    table = StepCosts(rows_plain=True)
    table.plain(9.0)  # the model's first plain step (its kernels' first use): dropped, as each row count's first
    assert table.t1() is None
    table.plain(1.0)
    table.verify(2, 1.0)
    table.verify(2, -1.0)  # a clock whose counters were reset during the step: no sample
    assert table.measured(2) == 0
    table.verify(2, 0.9)  # one sample, cheaper than a plain step (noise): not taken alone
    assert 1.0 < table.ratio(2) < table.prior(2)
    for _ in range(TRUSTED):
        table.verify(2, 1.2)
    assert table.ratio(2) == 1.2


def test_the_table_is_shared_by_a_models_sequences_per_kind_of_plain_step():
    class Model:
        pass

    model, other = Model(), Model()
    table = costs.shared(model, True, True, time.process_time)
    assert costs.shared(model, True, True, time.process_time) is table
    assert costs.shared(model, False, True, time.process_time) is not table  # batched plain steps: another
    assert costs.shared(model, True, True, time.perf_counter) is not table  # another clock: another
    assert costs.shared(other, True, True, time.process_time) is not table


def test_k_follows_acceptance_not_one_sequences_noisy_verifies():
    """The model's costs measured: 5 rows at ~1.9 plain steps. A sequence whose own verifies came out cheap (5 rows
    at 1.2 plain steps: its neighbours' load fell) still drafts a quote in progress (kept 95%) whole and drops a
    single-token match's draft (kept 15%). Where the model's 5 rows cost ~1.2 (and this sequence's verifies came
    out at 2.5), one token of the single-token draft is verified: the choice follows the model's table."""
    for slope, own, want in ((0.22, 1.2, []), (0.05, 2.5, [1])):
        spec = Speculator(PromptLookup(), k=4)
        spec.costs = _calibrated(slope)
        spec.observe(0, 0, 1, 1.0)
        for _ in range(3):
            spec.observe(4, 4, 5, own, bucket(Draft([1], match=12)))  # drafts kept, noisy times
        for _ in range(4):
            spec.observe(0, 0, 1, 1.0)
        spec.choose_k()
        assert abs(spec.costs.ratio(5) - (1 + 4 * slope)) < 0.05 * (1 + 4 * slope)
        assert spec.fit(Draft([1, 2, 3, 4], match=12)).tokens == [1, 2, 3, 4]
        assert spec.fit(Draft([1, 2, 3, 4], match=1)).tokens == want


def test_a_paged_step_is_timed_in_cpu_time_plus_the_pagers_counted_stall():
    """Reads cost time but no CPU: a paged model's steps are timed as CPU time plus the seconds its pager counts the
    compute thread waiting (every tier's), not wall time (which counts the neighbours' time slices); a provider
    that waits without counting (the page cache) is timed by the wall clock, a resident one in CPU time."""
    from types import SimpleNamespace as NS

    from localmoe.engine.spec.verify import step_clock

    tiers = {"ram": NS(stall_seconds=0.0), "gpu0": NS(stall_seconds=0.0)}
    pager = NS(waits=True, stats=NS(tiers=tiers))
    model = NS(moe_blocks=lambda: [NS(experts=pager), NS(experts=pager)])
    clock = step_clock(model)
    began = clock()
    tiers["ram"].stall_seconds += 2.0
    tiers["gpu0"].stall_seconds += 1.0
    assert 3.0 <= clock() - began < 3.5
    assert step_clock(NS(moe_blocks=lambda: [NS(experts=NS(waits=True))])) is time.perf_counter
    assert step_clock(NS(moe_blocks=lambda: [NS(experts=NS())])) is time.process_time
