"""Pure-function sampling: logits in, token ids out.

Order (as in llama.cpp and HF): repetition penalty -> temperature -> top-k -> top-p ->
min-p -> draw. Temperature 0 means greedy. Randomness comes only from the `generator`
passed in, so a seed reproduces a run.

Safe for every finite setting: the penalised logits are clamped to finite values and
shifted so the best is 0 before dividing by the temperature, so neither a temperature of
1e-300 nor a repetition penalty of 1e-300 can make an inf - inf (nan) in the softmax.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from localmoe.errors import LocalMoEError

FP32 = torch.finfo(torch.float32)


@dataclass(slots=True)
class SamplingParams:
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off; >1 discourages tokens already in the context
    seed: int | None = None

    def __post_init__(self) -> None:
        values = (self.temperature, self.top_p, self.min_p, self.repetition_penalty)
        if not all(math.isfinite(v) for v in values):
            raise LocalMoEError("temperature, top_p, min_p and repetition_penalty must be finite numbers")
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
        """Temperature 0, or one too small for float32 (below its smallest normal: the same argmax)."""
        return self.temperature < FP32.tiny

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
    info = torch.finfo(logits.dtype)
    penalty = min(max(penalty, info.tiny), info.max)  # in the dtype's range: 1e300 would be inf, and 0 * inf nan
    seen = logits.gather(-1, history)
    seen = torch.where(seen > 0, seen / penalty, seen * penalty)
    return logits.scatter(-1, history, seen.clamp(-info.max, info.max))  # a tiny penalty must not make inf


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


def probabilities(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> the distribution `sample` draws from, [B, V] fp32 (greedy: one-hot on the argmax).
    Speculative decoding accepts drafted tokens against it (engine/spec/accept.py)."""
    logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
    if params.greedy:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    logits = logits - logits.max(-1, keepdim=True).values  # the best is 0, so / temperature never gives inf - inf
    logits = filter_logits(logits / min(params.temperature, FP32.max), params.top_k, params.top_p, params.min_p)
    return logits.softmax(-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           history: torch.Tensor | None = None) -> torch.Tensor:
    """logits [B, V] -> token ids [B] (int64). A draw with `generator` runs where the generator is (the CPU:
    the same seed gives the same tokens whatever device made the logits)."""
    history = None if history is None else history.to(logits.device)
    if params.greedy:
        logits = apply_repetition_penalty(logits.float(), history, params.repetition_penalty)
        if logits.device.type == "cpu":  # numpy's argmax (the same first-of-equal-maxima rule, NaN first too):
            return torch.from_numpy(logits.numpy().argmax(-1))  # 4 us against torch's 43 us a row of 49152
        return logits.argmax(-1)
    if generator is not None and logits.device != generator.device:
        logits, history = logits.to(generator.device), None if history is None else history.to(generator.device)
    return torch.multinomial(probabilities(logits, params, history), 1, generator=generator).squeeze(-1)
