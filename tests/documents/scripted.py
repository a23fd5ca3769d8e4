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

    def measure(self, system: str, user: str) -> int:
        return self.count(system) + self.count(user) + 8  # 8: the chat template's own tokens

    def check_fits(self, system: str, user: str, max_tokens: int) -> None:
        """Refuse an overflowing prompt as the chat service does (prompt + max_tokens + 2 > context)."""
        needed = self.measure(system, user)
        self.peak = max(getattr(self, "peak", 0), needed + max_tokens)
        if needed + max_tokens + 2 > self.context:
            raise AssertionError(f"the prompt needs {needed} tokens + {max_tokens} for the reply, "
                                 f"but the context holds {self.context}")

    async def ask(self, system: str, user: str, max_tokens: int) -> str:
        if self.crash_after is not None and len(self.prompts) >= self.crash_after:
            raise RuntimeError("the model crashed (scripted)")
        self.check_fits(system, user, max_tokens)
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


class TemplateAsker(ExtractiveAsker):
    """ExtractiveAsker that counts with a real model's tokenizer and chat template (a started Service's)
    and its context, and refuses a prompt that would not fit exactly as the service would."""

    def __init__(self, service, context: int | None = None):
        super().__init__(context or service.context)
        self.tokenizer, self.format = service.tokenizer, service.format

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def measure(self, system: str, user: str) -> int:
        from localmoe.chat.format import ChatMessage

        return len(self.format.render([ChatMessage("system", system), ChatMessage("user", user)], tools=None,
                                      reasoning_effort="high"))


class FixedAsker(ExtractiveAsker):
    """Answers every call with `text`."""

    def __init__(self, text: str, context: int = 100_000):
        super().__init__(context)
        self.text = text

    async def ask(self, system: str, user: str, max_tokens: int) -> str:
        self.check_fits(system, user, max_tokens)
        self.prompts.append((system, user))
        return self.text
