"""Stopping a small model's loops: a detector the asker runs on the streamed answer (it cancels
the generation when the text starts repeating itself) and a pass that drops repeated lines and
sentences from a finished answer."""

from __future__ import annotations

import re

MIN_UNIT = 12  # characters: a repeated unit shorter than this ("| | |", "...") is not a loop
MAX_PERIOD = 400  # characters: the longest repeated unit looked for at the end of the text
REPEATS = 3  # a unit seen this many times in a row (or a line seen this many times) is a loop


def _key(text: str) -> str:
    return " ".join(text.casefold().split())


def loop_at(text: str) -> int | None:
    """Where the repetition the text ends in begins (its first copy kept), or None when it does not loop.

    Two patterns: the same unit REPEATS times back to back at the end ("A. A. A."), or a line
    of MIN_UNIT or more characters written REPEATS times anywhere."""
    tail = text[-REPEATS * MAX_PERIOD:]
    offset = len(text) - len(tail)
    for period in range(MIN_UNIT, len(tail) // REPEATS + 1):
        unit = tail[-period:]
        if tail.endswith(unit * REPEATS) and unit.strip():
            return offset + len(tail) - period * (REPEATS - 1)
    seen: dict[str, int] = {}
    at = 0
    for line in text.split("\n"):
        key = _key(line)
        if len(key) >= MIN_UNIT:
            seen[key] = seen.get(key, 0) + 1
            if seen[key] == REPEATS:
                return at
        at += len(line) + 1
    return None


def collapse_repeats(text: str) -> str:
    """`text` with lines and sentences that repeat an earlier one (case and spacing folded) dropped."""
    out_lines, seen = [], set()
    for line in text.split("\n"):
        sentences = re.split(r"(?<=[.!?])\s+", line)
        kept = []
        for sentence in sentences:
            key = _key(sentence)
            if len(key) >= MIN_UNIT and key in seen:
                continue
            seen.add(key)
            kept.append(sentence)
        if kept or not line.strip():
            out_lines.append(" ".join(kept))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out_lines)).strip()
