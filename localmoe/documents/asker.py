"""The model as the analysis pipeline sees it: its context size, a token counter, the size of a
whole rendered prompt, and one question-answer turn through the chat service (budgets and
formats included) whose streamed answer is cut when it starts looping."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from localmoe.documents.repetition import collapse_repeats, loop_at
from localmoe.errors import LocalMoEError

BUDGETS = ("low", "high", "max")
LOOP_CHECK_CHARS = 24  # the loop detector looks again after this many new characters (or a newline)


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    loops: int = 0  # answers cut because they started repeating themselves


@dataclass
class ServiceAsker:
    """Asks a started `localmoe.runtime.service.Service`; `budget` is passed on as reasoning_effort."""

    service: object
    budget: str = "high"
    temperature: float = 0.0
    usage: Usage = field(default_factory=Usage)

    def __post_init__(self) -> None:
        if self.budget not in BUDGETS:
            raise LocalMoEError(f"budget must be one of {', '.join(BUDGETS)}, not {self.budget!r}")

    @property
    def context(self) -> int:
        return int(self.service.context)

    def count(self, text: str) -> int:
        """Tokens of `text` with the model's tokenizer."""
        return len(self.service.tokenizer.encode(text, add_special_tokens=False))

    @property
    def sees_images(self) -> bool:
        """Whether the model has a vision tower that reads pictures (a PDF page's figures and scans)."""
        try:
            _ = self.service.loaded.image_encoder
        except (LocalMoEError, AttributeError):
            return False
        return True

    def image_tokens(self, data: bytes) -> int:
        """Prompt tokens one picture takes (its placeholders)."""
        return self.service.loaded.image_encoder.size(data)[2]

    def _messages(self, system: str, user: str, pictures: Sequence[tuple[int, bytes]] = ()):
        from localmoe.chat.format import ChatMessage
        from localmoe.chat.images import ImageRef

        return [ChatMessage("system", system),
                ChatMessage("user", user, images=[ImageRef.of(data, at) for at, data in pictures])]

    def measure(self, system: str, user: str, pictures: Sequence[tuple[int, bytes]] = ()) -> int:
        """Tokens of the whole prompt for (system, user and its pictures), rendered by the model's chat template."""
        messages = self._messages(system, user, pictures)
        if pictures:
            from localmoe.runtime.images import size_images

            messages = size_images(self.service.loaded, messages)
        return len(self.service.format.render(messages, tools=None, reasoning_effort=self.budget))

    async def ask(self, system: str, user: str, max_tokens: int, pictures: Sequence[tuple[int, bytes]] = ()) -> str:
        """The model's answer (`pictures`: (offset in `user`, image bytes)); generation stops early when the
        answer starts repeating itself."""
        from localmoe.engine.sampler import SamplingParams
        from localmoe.runtime.service import ChatRequest

        request = ChatRequest(messages=self._messages(system, user, pictures), max_tokens=max_tokens,
                              params=SamplingParams(temperature=self.temperature, repetition_penalty=1.1),
                              tool_mode="none", reasoning_effort=self.budget)
        stream = await self.service.chat(request)
        text, checked, looped, result = "", 0, False, None
        async for kind, payload in stream.events():
            if kind == "done":
                result = payload
                break
            if payload.channel != "content" or not payload.text:
                continue
            text += payload.text
            if "\n" in payload.text or len(text) - checked >= LOOP_CHECK_CHARS:
                checked = len(text)
                cut = loop_at(text)
                if cut is not None:
                    text, looped = text[:cut], True
                    stream.cancel()
                    break
        self.usage.calls += 1
        self.usage.loops += looped
        if result is not None:
            self.usage.prompt_tokens += result.prompt_tokens
            self.usage.completion_tokens += result.completion_tokens
            self.usage.seconds += result.seconds
            text = result.content
            cut = loop_at(text)
            if cut is not None:
                text, looped = text[:cut], True
                self.usage.loops += 1
        else:
            self.usage.prompt_tokens += len(stream.prompt)
            self.usage.completion_tokens += self.count(text)
        return collapse_repeats(text)
