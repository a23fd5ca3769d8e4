"""Drafters behind one interface: `propose(history, k, params, generator) -> Draft`.

- `PromptLookup`: no model. The last n tokens (n = max_ngram down to min_ngram) are looked up among
  the earlier ones (prompt and generated text, most recent occurrence first) and the tokens that
  followed are the draft. (Single-token matches are the weakest: SmolLM2 quoting a document kept 48%
  of the drafts with n >= 1 and 65% with n >= 2, 2.9 and 3.6 tokens per drafted step; `min_ngram`.) Agents' work (code edits, document Q&A, tool results quoted back) repeats
  long spans of the prompt, which this drafts for free. Deterministic: q is one-hot.
- `DraftModel`: a smaller model sharing the target's tokenizer (checked by `check_vocab`), run token
  by token over its own cache; it samples its drafts with the request's settings (greedy under
  greedy), so q is its distribution.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from localmoe.engine.sampler import SamplingParams, probabilities
from localmoe.errors import LocalMoEError


@dataclass(slots=True)
class Draft:
    tokens: list[int]
    q: torch.Tensor | None = None  # [k, V]: the distribution each draft was drawn from; None = deterministic
    source: int | None = None  # copied from the sequence: the position the first draft stood at (residency.py)


class Drafter(Protocol):
    name: str

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Draft:
        """Up to k tokens likely to follow `history` (the sequence so far, its last token not yet run)."""


class PromptLookup:
    """N-gram lookup over the sequence itself (see the module docstring). The index of n-grams grows with
    the history (each position indexed once), so a step costs O(max_ngram) whatever the context."""

    name = "prompt"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, not {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._index: dict[tuple[int, ...], int] = {}  # n-gram -> where its latest continuation starts
        self._seen: list[int] = []  # the history indexed so far

    def _update(self, history: Sequence[int]) -> None:
        n_seen = len(self._seen)
        if list(history[:n_seen]) != self._seen:  # another sequence (or a rewound one): index it afresh
            self._index.clear()
            self._seen, n_seen = [], 0
        for end in range(max(n_seen, 1), len(history)):  # n-grams ending before `end`, continued at `end`
            for n in range(1, min(self.max_ngram, end) + 1):
                self._index[tuple(history[end - n:end])] = end
        self._seen = list(history)

    def propose(self, history: Sequence[int], k: int, params: SamplingParams = None,
                generator: torch.Generator | None = None) -> Draft:
        if k <= 0 or len(history) < 2:
            return Draft([])
        self._update(history)
        for n in range(min(self.max_ngram, len(history) - 1), self.min_ngram - 1, -1):
            at = self._index.get(tuple(history[len(history) - n:]))
            if at is not None:
                return Draft(list(history[at:at + k]), source=at)
        return Draft([])


def check_vocab(target_tokenizer, draft_tokenizer, target_name: str, draft_name: str) -> None:
    """A draft model must share the target's tokenizer: the same vocabulary, ids and special tokens."""
    t, d = target_tokenizer, draft_tokenizer
    if t.vocab_size != d.vocab_size:
        raise LocalMoEError(f"draft model {draft_name}: its tokenizer has {d.vocab_size} tokens, the target "
                            f"{target_name}'s has {t.vocab_size}; use a draft model with the target's tokenizer "
                            "(the same family), or --spec prompt")
    t_vocab, d_vocab = t.backend.get_vocab(with_added_tokens=True), d.backend.get_vocab(with_added_tokens=True)
    if t_vocab != d_vocab:
        differ = sorted(set(t_vocab.items()) ^ set(d_vocab.items()), key=lambda kv: kv[1])[:3]
        raise LocalMoEError(f"draft model {draft_name}: its vocabulary differs from the target {target_name}'s "
                            f"(e.g. {differ}); use a draft model with the target's tokenizer, or --spec prompt")


class DraftModel:
    """A small model proposing drafts token by token over its own cache (batch 1). Its cache follows the
    sequence: tokens it holds that the sequence no longer has are trimmed (to a snapshot of its delta-rule
    states, taken where the accepted history ended), the missing ones are run as one chunk."""

    name = "draft"

    def __init__(self, model, vocab_size: int):
        self.model = model
        self.vocab_size = vocab_size  # the target's: a draft's logits are cut or padded (-inf) to it
        self.cache = model.new_cache(1, model.max_context)
        self.tokens: list[int] = []  # what the cache holds

    def _sync(self, history: Sequence[int]) -> torch.Tensor | None:
        """Make the cache hold `history`; the logits [1, V] after its last token (None: it cannot)."""
        keep = 0
        while keep < min(len(self.tokens), len(history) - 1) and self.tokens[keep] == history[keep]:
            keep += 1
        keep = self.cache.rollback_point(keep)
        self.cache.trim(keep)
        del self.tokens[keep:]
        todo = list(history[keep:])
        if self.cache.offset + len(todo) >= self.cache.max_len or max(todo) >= self.model.spec.vocab_size:
            return None  # no room, or an id past the draft's embedding (a target's padded vocabulary)
        logits = None
        with torch.inference_mode():
            for begin in range(0, len(todo), 512):
                logits = self.model.forward(torch.tensor([todo[begin:begin + 512]]), self.cache)[:, -1]
        self.tokens.extend(todo)
        self.cache.snapshot(keep_earlier=False)  # the next round trims back to here at most
        return self._fit(logits)

    def _fit(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [1, V_draft] -> [1, V_target]: the models pad their vocabularies differently (the
        tokenizer is the same, checked), so ids past the draft's get probability 0."""
        V = self.vocab_size
        if logits.shape[-1] >= V:
            return logits[:, :V]
        return torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator) -> Draft:
        k = min(k, self.cache.max_len - len(history) - 1)
        if k <= 0:
            return Draft([])
        logits = self._sync(history)
        if logits is None:
            return Draft([])
        tokens, qs = [], []
        for i in range(k):
            q = probabilities(logits, params)[0]
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            qs.append(q)
            if i + 1 < k:
                with torch.inference_mode():
                    logits = self._fit(self.model.forward(torch.tensor([[token]]), self.cache)[:, -1])
                self.tokens.append(token)
        return Draft(tokens, torch.stack(qs))
