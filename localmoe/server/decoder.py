"""One sequence's decode state, advanced one forward pass at a time by the engine worker.

The engine's `generate_step` is a closed loop (prompt in, sampled ids out). The server
needs three things it does not offer: a step at a time so one worker can interleave many
requests fairly, the logits (constrained tool-call arguments rank the vocabulary), and
injected tokens (a thinking budget appends the end-of-thinking marker). `Decoder` is the
same loop opened up: tokens not yet in the cache are `pending`; `logits()` runs them
through the model (a prompt in chunks, one chunk per call) and `feed()` queues the next.
With the same prompt and seed it samples exactly what `generate_step` samples.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localmoe.engine.generate import PREFILL_CHUNK
from localmoe.engine.sampler import SamplingParams, sample
from localmoe.errors import LocalMoEError


class Decoder:
    """Batch-1 decoding over a private cache of `max_len` positions."""

    def __init__(self, model, prompt: Sequence[int], params: SamplingParams, max_len: int,
                 prefill_chunk: int = PREFILL_CHUNK):
        if not prompt:
            raise LocalMoEError("the prompt is empty: there is nothing to continue")
        max_len = min(max_len, model.max_context)
        if len(prompt) >= max_len:
            raise LocalMoEError(f"the prompt has {len(prompt)} tokens but the context holds {max_len}")
        self.model = model
        self.params = params
        self.cache = model.new_cache(1, max_len)
        self.pending: list[int] = list(prompt)
        self.generator = params.make_generator()
        self.history: list[int] | None = list(prompt) if params.repetition_penalty != 1.0 else None
        self.chunk = prefill_chunk
        self.forwards = 0

    @property
    def room(self) -> int:
        """Positions still free in the cache once pending tokens are in."""
        return self.cache.max_len - self.cache.offset - len(self.pending)

    def logits(self) -> torch.Tensor | None:
        """Run pending tokens; logits [1, V] of the last one, or None while prompt chunks remain."""
        if not self.pending:
            raise RuntimeError("nothing pending: feed a token first")
        batch, self.pending = self.pending[:self.chunk], self.pending[self.chunk:]
        with torch.inference_mode():
            out = self.model.forward(torch.tensor([batch], dtype=torch.long), self.cache)
        self.forwards += 1
        return None if self.pending else out[:, -1]

    def sample(self, logits: torch.Tensor) -> int:
        history = torch.tensor([self.history], dtype=torch.long) if self.history is not None else None
        return int(sample(logits, self.params, self.generator, history))

    def feed(self, tokens: Sequence[int]) -> None:
        """Queue tokens (a sampled one, or injected ones) to be run by the next `logits()`."""
        self.pending.extend(tokens)
        if self.history is not None:
            self.history.extend(tokens)
