"""Thinking budgets: tiers, parsing, and the tracker's decisions (fake clock and byte counter)."""

from __future__ import annotations

import pytest

from localmoe.chat.budget import Action, Budget, BudgetTracker, ThinkingBudgets
from localmoe.errors import LocalMoEError


def test_tiers_and_parsing():
    budgets = ThinkingBudgets.parse("low=16, max=none")
    assert (budgets.limit_for("low"), budgets.limit_for("high"), budgets.limit_for("max")) == (16, 4096, None)
    assert budgets.limit_for(None) == budgets.high
    for bad in ("medium=3", "low=many", "low=0"):
        with pytest.raises(LocalMoEError):
            ThinkingBudgets.parse(bad)
    with pytest.raises(LocalMoEError):
        budgets.limit_for("extreme")


def test_reasoning_token_limit_closes_thinking_once_reached():
    tracker = BudgetTracker(Budget(reasoning_tokens=3))
    assert [tracker.check(True) for _ in range(3)] == [Action.CONTINUE, Action.CONTINUE, Action.CLOSE_THINKING]
    assert tracker.closed_by == "reasoning_tokens"
    assert tracker.check(False) is Action.CONTINUE  # answer tokens are not limited by the reasoning budget


class Fake:
    def __init__(self):
        self.now = 0.0
        self.read = 0


def test_wall_clock_budget_closes_then_stops():
    fake = Fake()
    tracker = BudgetTracker(Budget(seconds=2.0), clock=lambda: fake.now)
    fake.now = 1.0
    assert tracker.check(True) is Action.CONTINUE
    fake.now = 2.5
    assert tracker.check(True) is Action.CLOSE_THINKING and tracker.closed_by == "seconds"
    assert tracker.check(False) is Action.CONTINUE
    fake.now = 4.0  # the hard limit defaults to twice the soft one
    assert tracker.check(False) is Action.STOP


def test_bytes_read_budget():
    fake = Fake()
    fake.read = 1000  # bytes read before the generation do not count
    tracker = BudgetTracker(Budget(bytes_read=100, hard_bytes_read=500), bytes_counter=lambda: fake.read)
    fake.read = 1050
    assert tracker.check(True) is Action.CONTINUE
    fake.read = 1100
    assert tracker.check(True) is Action.CLOSE_THINKING and tracker.closed_by == "bytes_read"
    fake.read = 1500
    assert tracker.check(False) is Action.STOP


def test_negative_limits_are_refused():
    with pytest.raises(LocalMoEError):
        Budget(seconds=-1)
