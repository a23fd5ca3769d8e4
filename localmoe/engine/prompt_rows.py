"""Prompt chunks as rows of a batched decode step: each prefilling sequence's next chunk taken from its
pending prompt (`Decoder.take_prompt`), then each one's result from the step's logits (`Decoder._ran`). Used by
the plain batched step (engine/generate.py `decode_together`) and by the speculative one (engine/spec/verify.py),
so a prompt runs the same rows beside plain and speculating sequences."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class PromptRows:
    """The prompt chunks of a batched step (`decode_together(chunks=...)`): each sequence's next chunk taken
    from its pending prompt as rows, then each one's result from the step's logits."""

    def __init__(self, chunks: Sequence[tuple]):
        self.decoders = [prompt for prompt, _ in chunks]
        self.batches = [prompt.take_prompt(limit) for prompt, limit in chunks]
        self.tokens = [t for batch in self.batches for t in batch]
        self.caches = [prompt.cache for prompt, batch in zip(self.decoders, self.batches) for _ in batch]

    def wanted(self, first: int) -> list[int]:
        """The rows (numbered from `first`) whose logits are kept: each finished prompt's last token, whose
        logits start its generation."""
        ends, at = [], first
        for prompt, batch in zip(self.decoders, self.batches):
            at += len(batch)
            if not prompt.pending:
                ends.append(at - 1)
        return ends

    def results(self, logits: torch.Tensor) -> list[torch.Tensor | None]:
        """Each chunk's `_ran` result from the wanted rows' logits, in order."""
        out, at = [], 0
        for prompt, batch in zip(self.decoders, self.batches):
            last = logits[at:at + 1] if not prompt.pending else None
            at += last is not None
            out.append(prompt._ran(batch, last))
        return out
