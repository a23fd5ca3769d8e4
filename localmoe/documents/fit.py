"""Prompts sized from real token counts: every prompt the analysis sends is measured with the
model's tokenizer and chat template (`asker.measure`) before it is sent.

A `Fitter` knows one kind of call (its system prompt, the question and the reply it leaves
room for). It packs passages into prompts by their counted sizes, then measures each packed
prompt whole and moves passages to the next prompt until it fits, so no path length, file
count or context size can overflow the model's context."""

from __future__ import annotations

from dataclasses import replace

from localmoe.documents import prompts
from localmoe.documents.records import Chunk
from localmoe.errors import LocalMoEError

SAFETY = 8  # tokens kept free besides the reply: the service's own margin (2) and token seams between blocks
SEPARATOR = 2  # the blank line between two passage blocks


class Fitter:
    """Packs passages into prompts of one kind (`system`, `question`, `reply_tokens`) that fit `asker.context`."""

    def __init__(self, asker, system: str, question: str, reply_tokens: int):
        self.asker, self.system, self.question = asker, system, question
        self.limit = asker.context - reply_tokens - SAFETY  # the most prompt tokens one call may have
        self.base = asker.measure(system, prompts.passages_prompt(question, []))
        self.room = self.limit - self.base  # tokens of passage blocks one prompt holds
        if self.room < 64:
            raise LocalMoEError(f"the model's context ({asker.context} tokens) leaves no room for passages: the "
                                f"instructions and question take {self.base} tokens and the reply {reply_tokens}; "
                                "shorten the question or lower --max-tokens")
        self._sizes: dict[int, int] = {}

    def size(self, chunk: Chunk) -> int:
        """Tokens of the chunk's labelled block, counted once with the model's tokenizer."""
        if chunk.id not in self._sizes:
            picture = self.asker.image_tokens(chunk.image) if chunk.image is not None else 0
            self._sizes[chunk.id] = self.asker.count(prompts.passage_block(chunk)) + picture + SEPARATOR
        return self._sizes[chunk.id]

    def measure(self, chunks: list[Chunk]) -> int:
        """The whole prompt's tokens (pictures included), as the chat template renders it."""
        text, pictures = prompts.passages_with_pictures(self.question, chunks)
        return self.asker.measure(self.system, text, pictures) if pictures else self.asker.measure(self.system, text)

    def fits(self, chunks: list[Chunk]) -> bool:
        """Whether all `chunks` fit one prompt (counting stops as soon as they cannot)."""
        total = 0
        for chunk in chunks:
            total += self.size(chunk)
            if total > self.room:
                return False
        return self.measure(chunks) <= self.limit

    def clip(self, chunk: Chunk) -> Chunk:
        """`chunk` cut (at a word) so that it fits a prompt alone; the chunk itself when it does."""
        if self.measure([chunk]) <= self.limit:
            return chunk
        words = chunk.text.split(" ")
        lo, hi = 0, len(words)
        while lo < hi:  # the most words that fit
            mid = (lo + hi + 1) // 2
            if self.measure([replace(chunk, text=" ".join(words[:mid]))]) <= self.limit:
                lo = mid
            else:
                hi = mid - 1
        clipped = replace(chunk, text=" ".join(words[:lo]))
        if chunk.image is not None and self.measure([clipped]) > self.limit:  # the picture alone is too big
            clipped = replace(chunk, image=None)
            return self.clip(clipped) if self.measure([clipped]) > self.limit else clipped
        self._sizes.pop(chunk.id, None)
        return clipped

    def pack(self, chunks: list[Chunk], max_groups: int) -> list[list[Chunk]]:
        """`chunks` in order, in at most `max_groups` prompts that each fit; what does not fit is left out."""
        groups: list[list[Chunk]] = []
        pending = list(chunks)
        while pending and len(groups) < max_groups:
            group, used = [], 0
            while pending and (not group or used + self.size(pending[0]) <= self.room):
                chunk = pending.pop(0)
                if not group and self.size(chunk) > self.room:
                    chunk = self.clip(chunk)
                group.append(chunk)
                used += self.size(chunk)
            while len(group) > 1 and self.measure(group) > self.limit:  # the counted sum was a little low
                pending.insert(0, group.pop())
            groups.append(group)
        return groups


def fit_notes(asker, system: str, question: str, notes: list[str], reply_tokens: int) -> list[str]:
    """The leading `notes` (best groups first) whose reduce prompt fits, each cut to fit when alone."""
    limit = asker.context - reply_tokens - SAFETY
    kept: list[str] = []
    for note in notes:
        if asker.measure(system, prompts.reduce_prompt(question, kept + [note])) <= limit:
            kept.append(note)
        elif not kept:
            words = note.split(" ")
            while words and asker.measure(system, prompts.reduce_prompt(question, [" ".join(words)])) > limit:
                words = words[: len(words) * 3 // 4]
            if words:
                kept.append(" ".join(words))
        else:
            break
    return kept
