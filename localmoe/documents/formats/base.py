"""What every format reader returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from localmoe.documents.records import Section


class UnreadableFile(Exception):
    """The whole file cannot be read; the message says why and what to do."""


@dataclass
class Parsed:
    kind: str
    sections: list[Section]
    pages: int = 0
    problems: list[str] = field(default_factory=list)  # per-page trouble; the file is still used
