"""The MTP drafter: a checkpoint's next-n prediction layer (engine/nextn.py) proposes the drafts.

The layer's entry at position i reads the target's final-norm hidden state h_i and the token t_{i+1},
and predicts t_{i+2}. The target hands its hidden states over through its cache (`ModelCache.hidden_sink`,
set by `watch`): every forward tells the sink the positions it wrote. Prompt chunks are consumed at once
(the next token of each is known), so a long prompt holds no more than a chunk of hidden states; a verify
step's rows wait for the acceptance rule, since only the accepted ones stay in the target's cache.

`propose(history)` first brings the layer's own cache up to the target's (entries for every position
whose next token is known, i.e. up to the one before the pending token), then drafts d_1 from the last
entry and chains: the entry at the pending token's position takes the layer's own output y instead of
the target's h (not computed yet) and d_1 as the next token, giving d_2, and so on. The chained entries
are trimmed away afterwards (the cache rolls back like the target's caches after a verify); the next
step recomputes them from the target's real hidden states. A position whose hidden state the target
never computed here (a prompt prefix taken from the prefix cache) enters with h = 0: a poorer draft,
never a wrong token (the target verifies every draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localmoe.engine.cache import ModelCache
from localmoe.engine.sampler import SamplingParams, probabilities
from localmoe.engine.spec.drafters import Draft

CHUNK = 512  # positions per catch-up forward of the MTP layer


class MTPDrafter:
    """Drafts for one sequence from `head` (a NextN), over its own cache of the sequence."""

    name = "mtp"

    def __init__(self, head):
        self.head = head
        self.cache: ModelCache | None = None  # entries for positions 0 .. offset - 1
        self.seq: list[int] = []  # the sequence's tokens by position, as far as known (-1: not seen)
        self.hidden: dict[int, torch.Tensor] = {}  # position -> the target's hidden state [D], not consumed yet
        self._last: tuple[int, torch.Tensor, torch.Tensor] | None = None  # (position, logits, y) of the last entry

    def watch(self, cache: ModelCache) -> None:
        """Receive the hidden states of the target's forwards over `cache` (a new one after a preemption:
        its replayed positions agree with what this drafter holds, so nothing is lost)."""
        cache.hidden_sink = self.sink
        if self.cache is None:
            self.cache = self.head.new_cache(cache.max_len)

    def sink(self, start: int, tokens: torch.Tensor, hidden: torch.Tensor, settled: bool) -> None:
        """The target wrote `tokens` [T] at positions start.. with final-norm hidden states `hidden` [T, D];
        `settled`: the tokens stay (a prompt chunk), else they may be rejected drafts (a verify's rows)."""
        tokens = tokens.tolist()
        T = len(tokens)
        known = self.seq[start:start + T]
        differ = next((j for j, (a, b) in enumerate(zip(known, tokens)) if a != b), None)
        if differ is not None:
            self._rewind(start + differ)
        self.seq = self.seq[:start] + [-1] * (start - len(self.seq)) + tokens
        self._drop(start)
        first = self.cache.offset
        for j in range(max(0, first - start), T):
            self.hidden[start + j] = hidden[j]
        if settled and T > 1:  # a prompt chunk: every position but the last has its next token
            self._consume(start + T - 2)

    def _drop(self, position: int) -> None:
        for p in [p for p in self.hidden if p >= position]:
            del self.hidden[p]

    def _rewind(self, position: int) -> None:
        """The token at `position` changed: entries from position - 1 on read it (and later ones its h)."""
        keep = max(position - 1, 0)
        if keep < self.cache.offset:
            self.cache.trim(keep)
        if self._last is not None and self._last[0] >= keep:
            self._last = None

    def _consume(self, end: int) -> None:
        """Add entries for positions offset .. end (inclusive) whose next token is known."""
        first = self.cache.offset
        while first <= end and first + 1 < len(self.seq) and self.seq[first + 1] >= 0:
            last = min(end, first + CHUNK - 1, len(self.seq) - 2)
            while self.seq[last + 1] < 0:
                last -= 1
            zero = torch.zeros(self.head.spec.hidden_size)
            h = torch.stack([self.hidden.pop(p, zero) for p in range(first, last + 1)])
            tokens = torch.tensor(self.seq[first + 1:last + 2], dtype=torch.long)
            logits, y = self.head.forward(tokens, h, self.cache)
            self._last = (last, logits[-1], y[-1])
            first = last + 1

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None) -> Draft:
        n = len(history)  # the target's cache holds positions 0 .. n - 2; history[-1] is pending
        if self.cache is None or n < 2:
            return Draft([])
        same = next((p for p, (a, b) in enumerate(zip(self.seq, history)) if a != b), min(len(self.seq), n))
        if same < len(self.seq):
            self._rewind(same)
        self.seq = list(history)
        self._drop(min(same, n - 1))  # rows of rejected drafts, or of positions whose tokens changed
        self._consume(n - 2)
        k = min(k, self.cache.max_len - n)
        if k <= 0 or self._last is None or self._last[0] != n - 2:
            return Draft([])
        _, logits, y = self._last
        tokens, qs = [], []
        for i in range(k):
            q = probabilities(logits[None], params)[0]
            token = int(q.argmax()) if params.greedy else int(torch.multinomial(q, 1, generator=generator))
            tokens.append(token)
            qs.append(q)
            if i + 1 < k:
                logits, y = self.head.forward(torch.tensor([token]), y[None], self.cache)
                logits, y = logits[-1], y[-1]
        self.cache.trim(n - 1)  # the chained entries go; the next step recomputes them from the target's h
        return Draft(tokens, torch.stack(qs))
