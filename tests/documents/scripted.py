"""Stand-ins for the model where a test must be deterministic: they read the prompt the
pipeline built and answer from it, so what they cite is derived from the real passages."""

from __future__ import annotations

import re

from localmoe.documents.asker import Usage
from localmoe.documents.retrieval import tokens

PASSAGE = re.compile(r"^\[P(\d+)\] (.*?)\n(.*?)(?=\n\n\[P\d+\] |\n\nQuestion: )", re.DOTALL | re.MULTILINE)


def passages_in(prompt: str) -> dict[int, str]:
    return {int(m.group(1)): m.group(3) for m in PASSAGE.finditer(prompt)}


class ExtractiveAsker:
    """Quotes the sentence of the prompt's passages sharing most words with the question, cited by id.

    `context` is small on purpose when a test needs map-reduce; tokens are counted as words."""

    def __init__(self, context: int = 100_000, crash_after: int | None = None):
        self.context = context
        self.crash_after = crash_after
        self.prompts: list[tuple[str, str]] = []
        self.usage = Usage()

    def count(self, text: str) -> int:
        return len(text.split())

    async def ask(self, system: str, user: str, max_tokens: int) -> str:
        if self.crash_after is not None and len(self.prompts) >= self.crash_after:
            raise RuntimeError("the model crashed (scripted)")
        self.prompts.append((system, user))
        self.usage.calls += 1
        question = user.rsplit("Question: ", 1)[-1]
        if user.startswith("Notes:"):  # reduce: keep the note lines that cite something
            notes = user.split("\n\nQuestion: ")[0].splitlines()[1:]
            return "\n".join(n for n in notes if "[P" in n) or "The notes do not answer it."
        wanted = set(tokens(question))
        best = (0, 0, "")
        for pid, text in passages_in(user).items():
            for sentence in re.split(r"(?<=[.!?])\s+", " ".join(text.split())):
                score = len(wanted & set(tokens(sentence)))
                if score > best[0]:
                    best = (score, pid, sentence)
        if not best[0]:
            return "NONE"
        score, pid, sentence = best
        return f'{sentence} [P{pid}: "{sentence.rstrip(".")}"]'


class FixedAsker(ExtractiveAsker):
    """Answers every call with `text`."""

    def __init__(self, text: str, context: int = 100_000):
        super().__init__(context)
        self.text = text

    async def ask(self, system: str, user: str, max_tokens: int) -> str:
        self.prompts.append((system, user))
        return self.text
