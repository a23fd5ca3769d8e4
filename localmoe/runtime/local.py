"""The Python API's model (`localmoe.load()`): a loaded model with the runtime behind it, so a script
gets what every front end gets: the chat format, reasoning parsed apart from the answer, thinking
budgets, stop strings, images, and the one scheduler and batched step (`Service.run_here`).

    model = localmoe.load()
    for chunk in model.stream("What is the capital of France?", thinking="low"):
        print(chunk.text, end="")
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from localmoe.chat import ChatMessage, messages_from_openai
from localmoe.chat.format import ToolCall
from localmoe.chat.images import ImageRef
from localmoe.engine.sampler import SamplingParams
from localmoe.errors import LocalMoEError
from localmoe.runtime.service import ChatRequest, ServerConfig, Service
from localmoe.runtime.turn import TurnResult


@dataclass
class Chunk:
    """One piece of a streamed answer; the last one carries the finish reason and the whole turn."""

    text: str = ""  # new answer text
    reasoning: str = ""  # new reasoning text (a thinking model's)
    tool_call: ToolCall | None = None
    finish_reason: str | None = None  # last chunk: "stop" | "length" | "tool_calls"
    result: TurnResult | None = None  # last chunk: texts, token counts, time to first token, seconds


class LocalModel:
    """A loaded model (`LoadedModel`: spec, model, tokenizer, chat_prompt, ... read through) generating
    through the runtime in the caller's thread."""

    def __init__(self, loaded, config: ServerConfig | None = None):
        self.loaded = loaded
        # one caller, one sequence at a time: the fused single-sequence step where the model has one (batching
        # only pays with several sequences, and auto may batch a model whose rows run the multi-row kernels)
        self.service = Service(loaded, config or ServerConfig(prefix_cache_entries=0, batching="off"))

    def __getattr__(self, name: str):
        return getattr(self.loaded, name)

    def events(self, prompt: str | list[dict], params: SamplingParams | None = None, max_tokens: int = 256,
               stop: Sequence[str] = (), system: str | None = None, images: Sequence = (),
               thinking: str | None = None) -> Iterator[tuple[str, object]]:
        """The chat turn's events for a user message (str) or OpenAI-style messages: ("delta", Delta) ...
        ("done", TurnResult). `images` (paths or file bytes) go before a str prompt's text, for a model with
        a vision tower (engine/images.py); `thinking`: "low" | "high" | "max" (the reasoning budget tier)."""
        if isinstance(prompt, str):
            refs = [ImageRef.of(image if isinstance(image, bytes) else Path(image).read_bytes()) for image in images]
            messages = ([ChatMessage("system", system)] if system else []) + [ChatMessage("user", prompt, images=refs)]
        elif images:
            raise LocalMoEError("images go with a text prompt (str), not a message list")
        else:
            messages = messages_from_openai(prompt)
        request = ChatRequest(messages, max_tokens, params or SamplingParams(), stop=list(stop),
                              reasoning_effort=thinking)
        return self.service.chat_here(request)

    def stream(self, prompt: str | list[dict], params: SamplingParams | None = None, max_tokens: int = 256,
               stop: Sequence[str] = (), system: str | None = None, images: Sequence = (),
               thinking: str | None = None) -> Iterator[Chunk]:
        """Stream the answer as `Chunk`s (arguments as `events`)."""
        for kind, payload in self.events(prompt, params, max_tokens, stop, system, images, thinking):
            if kind == "done":
                yield Chunk(finish_reason=payload.finish_reason, result=payload)
            elif payload.tool_call is not None:
                yield Chunk(tool_call=payload.tool_call)
            elif payload.channel == "reasoning":
                yield Chunk(reasoning=payload.text)
            else:
                yield Chunk(text=payload.text)

    def generate(self, prompt: str | list[dict], params: SamplingParams | None = None, max_tokens: int = 256,
                 stop: Sequence[str] = (), system: str | None = None, images: Sequence = (),
                 thinking: str | None = None) -> TurnResult:
        """The whole turn: `.content`, `.reasoning`, `.tool_calls`, `.finish_reason`, token counts, timings."""
        return _result(self.events(prompt, params, max_tokens, stop, system, images, thinking))

    def complete(self, prompt: str | list[int], params: SamplingParams | None = None, max_tokens: int = 256,
                 stop: Sequence[str] = (), on_prompt: Callable[[], None] | None = None) -> TurnResult:
        """A plain continuation of `prompt` (text, or token ids used as they are: no chat template), ending at
        an end-of-turn token, a stop string or `max_tokens`; `on_prompt` is called once the prompt is in the
        cache, before the first token is drawn."""
        prep = self.service.prepare_completion(prompt, max_tokens, params or SamplingParams(), list(stop))
        prep.on_prompt = on_prompt
        return _result(self.service.completion_here(prep))


def _result(events: Iterator[tuple[str, object]]) -> TurnResult:
    for kind, payload in events:
        if kind == "done":
            return payload
    raise LocalMoEError("the generation ended without a result")  # run_here raises a job's error itself
