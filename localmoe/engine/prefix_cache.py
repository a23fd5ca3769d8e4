"""Reuse of a finished sequence's cache by the next prompt that starts with the same tokens.

A chat's next turn, or an agent resending its whole conversation, repeats everything the
previous request held; prefilling that again is most of the time to first token on a long
conversation (a CPU prefills tens to hundreds of tokens per second). Finished sequences
leave their cache here with the tokens it holds; a new prompt takes the entry with the
longest reusable common prefix, trimmed to it, and prefills only the rest.

Reuse is exact by construction: a fresh prefill runs the prompt in chunks of `grain`
positions (PREFILL_CHUNK) from position 0, and a chunk's output depends only on the cache
before it and its own tokens. So positions reused up to a multiple of `grain`, within the
part the previous sequence also prefilled (not its generated tokens, which ran one by one
through other kernels), hold exactly what a fresh prefill would compute, and the chunks after
them are the same calls: the logits are bit for bit those of a fresh run. The prompt's last
token always runs (its logits start the generation).

A prompt may also name an `anchor`: the end of its conversation's fixed header (system message and
tool definitions, the same on every turn and every request that sends them). A chunk then ends there
(chunks of `grain` from 0 up to the anchor, then from the anchor on), so the header's cache is
reusable as it is by any prompt with the same anchor: a header shorter than `grain` (a few tool
definitions: ~400 tokens) is reused instead of prefilled on every request. Reuse stays exact: the
chunks before a reused position are the same calls in both prompts.

Paged K/V and MLA rows trim to any position; a delta-rule state cannot be rolled back, so the
`Decoder` snapshots it at each chunk boundary of the prompt (keeping the latest only).
Entries are kept most recent last (a use counts), at most `max_entries` and `max_bytes` of cache in all.

A header is shared: a prompt that reuses no more of an entry than its anchor (the header every request with it
sends) takes a copy of those positions (`ModelCache.copy`: the blocks that cover them, the delta-rule state at the
anchor) and the entry stays for the next one, so a burst of requests with one header prefills it once, not once
per entry; a prompt that reuses more (a conversation's next turn) takes the entry itself, as one sequence continues
it. A sequence that prefills a header the cache does not hold leaves a copy of it here as soon as its prompt
passes the anchor (`keep_header`), so the prompts of a burst that wait one step for it start from it
(runtime/worker.py). An entry that a newer one covers (every prefix it can give, the newer gives: a header alone,
or a short conversation whose reuse stops at its header) goes when the newer comes, so the places hold distinct
prefixes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localmoe.engine.cache import ModelCache

DEFAULT_ENTRIES = 4
DEFAULT_BYTES = 2 << 30


def is_boundary(position: int, grain: int, anchor: int | None) -> bool:
    """Whether a prompt chunk ends at `position` when prompts run in chunks of `grain` from 0, one ending at
    `anchor` (None: none), then in chunks of `grain` from there."""
    if anchor is None or position <= anchor:
        return position % grain == 0 or position == anchor
    return (position - anchor) % grain == 0


def next_boundary(position: int, grain: int, anchor: int | None) -> int:
    """The first position after `position` where a chunk ends (`is_boundary`)."""
    if anchor is not None and position < anchor:
        return min(anchor, (position // grain + 1) * grain)
    base = anchor or 0
    return base + ((position - base) // grain + 1) * grain


def shared_boundaries(limit: int, grain: int, a: int | None, b: int | None) -> list[int]:
    """Positions up to `limit`, highest first, where both prompts (anchors `a`, `b`) end a chunk after the
    same chunks: every boundary when the anchors are equal, else the multiples of `grain` below both."""
    if a == b:
        points = {p for p in range(0, limit + 1, grain) if a is None or p <= a}
        if a is not None:
            points |= set(range(a, limit + 1, grain))
    else:
        top = min(limit, *(x for x in (a, b) if x is not None))
        points = set(range(0, top + 1, grain))
    return sorted(points, reverse=True)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """Caches of finished batch-1 sequences with the tokens each holds (see the module docstring)."""

    def __init__(self, max_entries: int = DEFAULT_ENTRIES, max_bytes: int = DEFAULT_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.entries: list[Entry] = []  # most recent last
        self.hits = self.misses = self.reused_tokens = 0

    def _best(self, prompt: Sequence[int], grain: int, anchor: int | None, whole: bool) -> tuple[int | None, int]:
        """(index of the entry with the longest reusable prefix of `prompt`, its length); `whole`: the whole
        prompt may be reused (else its last token must run)."""
        best, best_len = None, 0
        for i, entry in enumerate(self.entries):
            limit = min(common_prefix(entry.tokens, prompt), entry.prefilled, len(prompt) - (0 if whole else 1))
            for point in shared_boundaries(limit, grain, anchor, entry.anchor):
                if point <= best_len:
                    break
                if entry.cache.rollback_point(point) == point:
                    best, best_len = i, point
                    break
        return best, best_len

    def holds(self, prompt: Sequence[int], grain: int, anchor: int | None = None) -> int:
        """How many leading positions of `prompt` an entry could give it (nothing is taken)."""
        return self._best(prompt, grain, anchor, whole=True)[1]

    def take(self, prompt: Sequence[int], grain: int, anchor: int | None = None,
             again: bool = False) -> tuple[ModelCache | None, int]:
        """A cache holding the longest reusable prefix of `prompt` (trimmed to it) and that prefix's length;
        (None, 0) when nothing is reusable. Within an entry's header (up to its anchor) it is a copy and the entry
        stays; past it, the entry's own cache, removed from here (one sequence continues it). `again`: a second
        look for a prompt whose first look missed (counted once)."""
        best, best_len = self._best(prompt, grain, anchor, whole=False)
        if best is None:
            self.misses += not again
            return None, 0
        entry = self.entries.pop(best)
        if entry.anchor is not None and best_len <= entry.anchor:  # a header: every request with it may take it
            cache = entry.cache.copy(best_len)
            self.entries.append(entry)  # used: the most recent
        else:
            cache = entry.cache
            cache.trim(best_len)
        self.hits += 1
        self.misses -= again
        self.reused_tokens += best_len
        return cache, best_len

    def keep_header(self, header: Sequence[int], cache: ModelCache, grain: int) -> None:
        """Keep a copy of `cache`'s first len(`header`) positions (a prompt's header: `cache` holds it, prefilled
        in chunks of `grain` ending at its end), unless an entry holds it already (or the cache cannot come back
        to its end)."""
        anchor = len(header)
        if self.max_entries <= 0 or self.holds(header, grain, anchor) >= anchor or \
                cache.rollback_point(anchor) != anchor:
            return
        self.put(header, cache.copy(anchor), anchor, grain, anchor)

    def put(self, tokens: Sequence[int], cache: ModelCache, prefilled: int, grain: int,
            anchor: int | None = None) -> None:
        """Keep `cache` (holding exactly `tokens`, of which the first `prefilled` ran as prompt chunks of `grain`,
        one ending at `anchor`). An entry it covers (`Entry.covered_by`) goes."""
        if cache.batch != 1 or cache.offset != len(tokens) or cache.key_mask is not None or not tokens:
            return
        reach = next(p for p in shared_boundaries(prefilled, grain, anchor, anchor) if cache.rollback_point(p) == p)
        new = Entry(list(tokens), cache, prefilled, anchor, grain, reach)
        self.entries = [e for e in self.entries if not e.covered_by(new)] + [new]
        while self.entries and (len(self.entries) > self.max_entries or self.nbytes() > self.max_bytes):
            self.entries.pop(0)

    def clear(self) -> None:
        self.entries.clear()

    def nbytes(self) -> int:
        return sum(entry.cache.nbytes() for entry in self.entries)


@dataclass
class Entry:
    tokens: list[int]
    cache: ModelCache
    prefilled: int  # leading positions computed as prompt chunks (exact for reuse)
    anchor: int | None = None  # where its prompt's header ended a chunk (None: chunks of the grain from 0)
    grain: int = 0  # the prompt's chunk
    reach: int = 0  # the longest prefix it can give (its last chunk end within `prefilled` its cache comes back to)

    def covered_by(self, other: Entry) -> bool:
        """Whether `other` gives every prompt what this entry gives it: the same chunks (anchor, grain), the same
        tokens up to this entry's reach, prefilled, and its cache comes back there (a K/V cache to any point below
        too; a delta-rule one keeps one snapshot, as this one). A header alone (`keep_header`, `Service.warm`), or a
        short conversation whose reuse stops at its header, gives way to the next sequence with that header."""
        p = self.reach
        return other.anchor == self.anchor and other.grain == self.grain and other.prefilled >= p and \
            other.tokens[:p] == self.tokens[:p] and other.cache.rollback_point(p) == p
