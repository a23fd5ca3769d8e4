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

Paged K/V and MLA rows trim to any position; a delta-rule state cannot be rolled back, so the
`Decoder` snapshots it at each chunk boundary of the prompt (keeping the latest only).
Entries are kept most recent last, at most `max_entries` and `max_bytes` of cache in all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from localmoe.engine.cache import ModelCache

DEFAULT_ENTRIES = 4
DEFAULT_BYTES = 2 << 30


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

    def take(self, prompt: Sequence[int], grain: int) -> tuple[ModelCache | None, int]:
        """The cache holding the longest reusable prefix of `prompt` (trimmed to it, removed from here,
        since one sequence uses it) and that prefix's length; (None, 0) when nothing is reusable."""
        best, best_len = None, 0
        for i, entry in enumerate(self.entries):
            limit = min(common_prefix(entry.tokens, prompt), entry.prefilled, len(prompt) - 1)
            reusable = entry.cache.rollback_point(limit - limit % grain)
            reusable -= reusable % grain
            if reusable > best_len:
                best, best_len = i, reusable
        if best is None:
            self.misses += 1
            return None, 0
        cache = self.entries.pop(best).cache
        cache.trim(best_len)
        self.hits += 1
        self.reused_tokens += best_len
        return cache, best_len

    def put(self, tokens: Sequence[int], cache: ModelCache, prefilled: int) -> None:
        """Keep `cache` (holding exactly `tokens`, of which the first `prefilled` ran as prompt chunks)."""
        if cache.batch != 1 or cache.offset != len(tokens) or cache.key_mask is not None or not tokens:
            return
        self.entries.append(Entry(list(tokens), cache, prefilled))
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
