"""Generation: `generate_step` (token ids) -> `stream_generate` (text chunks) -> `generate` (result).

`generate_step` owns prefill (in chunks) and the decode loop and knows nothing about
text. `stream_generate` adds detokenisation, stop tokens, stop strings and timing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Protocol, Sequence

import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.sampler import SamplingParams, sample
from localmoe.errors import LocalMoEError

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activation memory, keeps GEMMs efficient


class CausalLM(Protocol):
    max_context: int

    def new_cache(self, batch: int = 1, max_len: int | None = None) -> ModelCache: ...

    def forward(self, tokens: torch.Tensor, cache: ModelCache, mask=None, all_logits: bool = False) -> torch.Tensor: ...


def prefill(model: CausalLM, prompt: Sequence[int], cache: ModelCache, chunk: int = PREFILL_CHUNK) -> torch.Tensor:
    """Run the prompt through the model in chunks; logits [1, V] of its last position."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    logits = None
    for begin in range(0, ids.shape[1], chunk):
        logits = model.forward(ids[:, begin:begin + chunk], cache)
    return logits[:, -1]


def generate_step(model: CausalLM, prompt: Sequence[int], params: SamplingParams,
                  cache: ModelCache | None = None, prefill_chunk: int = PREFILL_CHUNK) -> Iterator[int]:
    """Yield sampled token ids forever (the caller decides when to stop). Batch 1."""
    if not prompt:
        raise LocalMoEError("the prompt is empty: there is nothing to continue")
    cache = cache or model.new_cache(1)
    if cache.offset + len(prompt) >= cache.max_len:
        raise LocalMoEError(f"the prompt has {len(prompt)} tokens but the context holds {cache.max_len}; "
                            f"shorten it or raise --max-context")
    generator = params.make_generator()
    history = torch.tensor([list(prompt)], dtype=torch.long) if params.repetition_penalty != 1.0 else None
    logits = prefill(model, prompt, cache, prefill_chunk)
    while True:
        token = sample(logits, params, generator, history)
        if history is not None:
            history = torch.cat([history, token[:, None]], dim=1)
        yield int(token)
        if cache.offset >= cache.max_len:
            return  # context full: nothing more can be generated
        logits = model.forward(token.view(1, 1), cache)[:, -1]


@dataclass(slots=True)
class GenerationStats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    time_to_first_token: float = 0.0  # seconds from the call to the first sampled token
    decode_seconds: float = 0.0  # from the first to the last token

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.generated_tokens - 1
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds > 0 else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.time_to_first_token if self.time_to_first_token > 0 else 0.0

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "generated_tokens": self.generated_tokens,
                "time_to_first_token_s": round(self.time_to_first_token, 4),
                "prefill_tokens_per_s": round(self.prefill_tokens_per_second, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_second, 2)}


@dataclass(slots=True)
class GenerationChunk:
    text: str  # new text since the previous chunk (may be empty)
    token: int | None  # the token that produced it (None for the final chunk)
    finish_reason: str | None = None  # "stop" | "length" on the final chunk
    stats: GenerationStats | None = None  # final chunk only
    tokens: list[int] | None = None  # final chunk only: every generated token id (stop token excluded)


@dataclass(slots=True)
class GenerationResult:
    text: str
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    stats: GenerationStats = field(default_factory=GenerationStats)


def _held_back(text: str, stops: Sequence[str]) -> int:
    """How many trailing characters of `text` could start a stop string (must not be emitted yet)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    return hold


def stream_generate(model: CausalLM, tokenizer, prompt: Sequence[int], params: SamplingParams,
                    max_tokens: int = 256, stop: Sequence[str] = (), stop_token_ids: set[int] | None = None,
                    cache: ModelCache | None = None) -> Iterator[GenerationChunk]:
    """Stream text chunks; the last chunk carries finish_reason, stats and all token ids.

    Generation ends at any id in `stop_token_ids` (default: the tokenizer's end-of-turn
    ids; not emitted), at a stop string (not emitted), after `max_tokens` tokens, or when
    the context is full.
    """
    from localmoe.tokenizer import StreamDecoder

    if max_tokens < 1:
        raise LocalMoEError("max_tokens must be at least 1")
    stops = [s for s in stop if s]
    stop_ids = tokenizer.stop_token_ids if stop_token_ids is None else stop_token_ids
    stats = GenerationStats(prompt_tokens=len(prompt))
    decoder = StreamDecoder(tokenizer)
    tokens: list[int] = []
    pending = ""  # decoded text held back because it may begin a stop string
    finish = "length"
    started = time.perf_counter()
    first_at = started
    for token in generate_step(model, prompt, params, cache):
        now = time.perf_counter()
        if stats.generated_tokens == 0:
            first_at = now
            stats.time_to_first_token = now - started
        stats.generated_tokens += 1
        stats.decode_seconds = now - first_at
        if token in stop_ids:
            finish = "stop"
            break
        tokens.append(token)
        last = len(tokens) >= max_tokens
        pending += decoder.feed(token) + (decoder.flush() if last else "")
        cuts = [i for i in (pending.find(s) for s in stops) if i >= 0]
        if cuts:
            pending, finish = pending[:min(cuts)], "stop"
            break
        if last:
            break
        keep = _held_back(pending, stops)
        emit, pending = pending[:len(pending) - keep], pending[len(pending) - keep:]
        if emit:
            yield GenerationChunk(emit, token)
    else:  # the context filled up
        pending += decoder.flush()
    yield GenerationChunk(pending, None, finish, stats, tokens)


def collect(chunks: Iterator[GenerationChunk]) -> GenerationResult:
    """Drain a chunk stream into one GenerationResult."""
    parts = []
    result = GenerationResult(text="")
    for chunk in chunks:
        parts.append(chunk.text)
        if chunk.finish_reason:
            result.finish_reason, result.stats, result.tokens = chunk.finish_reason, chunk.stats, chunk.tokens
    result.text = "".join(parts)
    return result


def generate(model: CausalLM, tokenizer, prompt: Sequence[int], params: SamplingParams, max_tokens: int = 256,
             stop: Sequence[str] = (), stop_token_ids: set[int] | None = None) -> GenerationResult:
    """Generate to completion and return the whole text, token ids and stats."""
    return collect(stream_generate(model, tokenizer, prompt, params, max_tokens, stop, stop_token_ids))
