"""The model as the analysis pipeline sees it: its context size, a token counter, and one
question-answer turn through the chat service (sessions, budgets and formats included)."""

from __future__ import annotations

from dataclasses import dataclass, field

from localmoe.errors import LocalMoEError

BUDGETS = ("low", "high", "max")


@dataclass
class Usage:
    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0


@dataclass
class ServiceAsker:
    """Asks a started `localmoe.server.service.Service`; `budget` is passed on as reasoning_effort."""

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
        return len(self.service.tokenizer.encode(text, add_special_tokens=False))

    async def ask(self, system: str, user: str, max_tokens: int) -> str:
        from localmoe.chat.format import ChatMessage
        from localmoe.engine.sampler import SamplingParams
        from localmoe.server.service import ChatRequest

        request = ChatRequest(messages=[ChatMessage("system", system), ChatMessage("user", user)],
                              max_tokens=max_tokens, params=SamplingParams(temperature=self.temperature,
                                                                           repetition_penalty=1.1),
                              tool_mode="none", reasoning_effort=self.budget)
        stream = await self.service.chat(request)
        result = await stream.result()
        self.usage.calls += 1
        self.usage.prompt_tokens += result.prompt_tokens
        self.usage.completion_tokens += result.completion_tokens
        self.usage.seconds += result.seconds
        return result.content
