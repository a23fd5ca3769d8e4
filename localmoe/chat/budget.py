"""Thinking budgets: reasoning tokens, wall-clock seconds and bytes read from disk.

A reasoning effort tier (low / high / max) maps to a reasoning-token limit
(`ThinkingBudgets`, configurable). While the model reasons, `BudgetTracker.check` says when
a limit has run out; the caller then appends the format's end-of-thinking ids and the
model goes on to answer. The wall-clock and bytes-read budgets matter when experts stream
from disk and one token can cost seconds: their soft limit closes the reasoning the same
way, their hard limit (twice the soft one unless given) ends the generation.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass

from localmoe.chat.format import REASONING_EFFORTS
from localmoe.errors import LocalMoEError


@dataclass(slots=True)
class ThinkingBudgets:
    """Reasoning-token limit of each effort tier (None: unlimited)."""

    low: int | None = 256
    high: int | None = 4096
    max: int | None = None

    def __post_init__(self) -> None:
        for tier in REASONING_EFFORTS:
            value = getattr(self, tier)
            if value is not None and value < 1:
                raise LocalMoEError(f"the {tier} thinking budget must be at least 1 token, not {value}")

    def __str__(self) -> str:
        """As `parse` reads it: "low=256,high=4096,max=none"."""
        return ",".join(f"{tier}={'none' if getattr(self, tier) is None else getattr(self, tier)}"
                        for tier in REASONING_EFFORTS)

    def limit_for(self, effort: str | None) -> int | None:
        """The reasoning-token limit of `effort` (None effort: the `high` tier)."""
        if effort is None:
            return self.high
        if effort not in REASONING_EFFORTS:
            raise LocalMoEError(f"reasoning_effort must be one of {', '.join(REASONING_EFFORTS)}, not {effort!r}")
        return getattr(self, effort)

    @classmethod
    def parse(cls, text: str) -> ThinkingBudgets:
        """From "low=256,high=4096,max=none" (any subset of the tiers)."""
        values: dict[str, int | None] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            tier, _, number = part.partition("=")
            tier = tier.strip()
            if tier not in REASONING_EFFORTS:
                raise LocalMoEError(f"thinking budget tier must be one of {', '.join(REASONING_EFFORTS)}, "
                                    f"not {tier!r} (write e.g. low=256,high=4096,max=none)")
            number = number.strip().lower()
            try:
                values[tier] = None if number in ("none", "") else int(number)
            except ValueError:
                raise LocalMoEError(f"thinking budget for {tier} must be a number of tokens or none, "
                                    f"not {number!r}") from None
        return cls(**values)


@dataclass(slots=True)
class Budget:
    """The limits of one generation (None: no limit)."""

    reasoning_tokens: int | None = None
    seconds: float | None = None  # soft: closes the reasoning
    bytes_read: int | None = None  # soft: closes the reasoning
    hard_seconds: float | None = None  # ends the generation (default 2 x seconds)
    hard_bytes_read: int | None = None  # ends the generation (default 2 x bytes_read)

    def __post_init__(self) -> None:
        for name in ("reasoning_tokens", "seconds", "bytes_read", "hard_seconds", "hard_bytes_read"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise LocalMoEError(f"budget {name} must be >= 0, not {value}")
        if self.hard_seconds is None and self.seconds is not None:
            self.hard_seconds = 2 * self.seconds
        if self.hard_bytes_read is None and self.bytes_read is not None:
            self.hard_bytes_read = 2 * self.bytes_read


class Action(enum.Enum):
    CONTINUE = "continue"
    CLOSE_THINKING = "close_thinking"  # append end-of-thinking ids, go on to the answer
    STOP = "stop"  # end the generation now (finish_reason "length")


def process_bytes_read() -> int:
    """Bytes this process has read from storage so far (0 where the OS does not say)."""
    try:
        import psutil

        return int(psutil.Process().io_counters().read_bytes)
    except Exception:  # noqa: BLE001 - io_counters is missing on some platforms
        return 0


class BudgetTracker:
    """Follows one generation against its Budget; `check` after every generated token."""

    def __init__(self, budget: Budget, clock: Callable[[], float] = time.monotonic,
                 bytes_counter: Callable[[], int] = process_bytes_read):
        self.budget = budget
        self._clock = clock
        self._bytes = bytes_counter
        self._t0 = clock()
        self._b0 = bytes_counter() if (budget.bytes_read is not None or budget.hard_bytes_read is not None) else 0
        self.reasoning_tokens = 0
        self.closed_by: str | None = None  # which limit closed the reasoning, if one did

    @property
    def elapsed(self) -> float:
        return self._clock() - self._t0

    @property
    def bytes_read(self) -> int:
        if self.budget.bytes_read is None and self.budget.hard_bytes_read is None:
            return 0
        return self._bytes() - self._b0

    def check(self, reasoning: bool) -> Action:
        """Call once per generated token; `reasoning`: the token belongs to the reasoning channel."""
        b = self.budget
        if reasoning:
            self.reasoning_tokens += 1
        elapsed = self.elapsed if (b.seconds is not None or b.hard_seconds is not None) else 0.0
        read = self.bytes_read
        if (b.hard_seconds is not None and elapsed >= b.hard_seconds) or (
                b.hard_bytes_read is not None and read >= b.hard_bytes_read):
            return Action.STOP
        if not reasoning:
            return Action.CONTINUE
        for name, used, limit in (("reasoning_tokens", self.reasoning_tokens, b.reasoning_tokens),
                                  ("seconds", elapsed, b.seconds), ("bytes_read", read, b.bytes_read)):
            if limit is not None and used >= limit:
                self.closed_by = name
                return Action.CLOSE_THINKING
        return Action.CONTINUE
