"""Pure-function sampling: logits in, token ids out.

Order (as in llama.cpp and HF): repetition penalty -> temperature -> top-k -> top-p ->
min-p -> draw. Temperature 0 means greedy. Randomness comes only from the `generator`
passed in, so a seed reproduces a run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from localmoe.errors import LocalMoEError


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in the context
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, "temperature must be >= 0"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (self.top_k >= 0, "top_k must be >= 0"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
        ]
        for ok, message in checks:
            if not ok:
                raise LocalMoEError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self) -> torch.Generator:
        generator = torch.Generator()
        if self.seed is None:
            generator.seed()
        else:
            generator.manual_seed(self.seed)
        return generator


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """logits [B, V]; history [B, N] token ids: positive logits / penalty, negative * penalty (CTRL rule)."""
    if history is None or penalty == 1.0 or history.numel() == 0:
        return logits
    seen = logits.gather(-1, history)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, history, seen)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Set logits outside the top-k / nucleus / min-p sets to -inf. logits [B, V] fp32."""
    if top_k and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the tokens ranked above it already reach top_p (always keep the best)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    if min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64)."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.greedy:
        return logits.argmax(-1)
    logits = filter_logits(logits / params.temperature, params.top_k, params.top_p, params.min_p)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
