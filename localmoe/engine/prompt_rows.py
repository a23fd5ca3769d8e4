"""Prompt chunks as rows of a batched decode step: each prefilling sequence's next chunk taken from its
pending prompt (`Decoder.take_prompt`) runs as more rows of the step's forward, then each one's result comes
from the step's logits (`Decoder._ran`). Used by the plain batched step (engine/generate.py `decode_together`)
and by the speculative one (engine/spec/verify.py), so a prompt runs the same rows beside plain and speculating
sequences."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localmoe.engine.batch import forward_rows


def forward_with_prompts(model, tokens: Sequence[int], caches: Sequence, chunks: Sequence[tuple]
                         ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`forward_rows` over `tokens` (row n on caches[n]) plus each chunk's (decoder, limit) next prompt chunk
    as more rows -> (the logits of the `tokens` rows [N, V], each chunk's `_ran` result: its prompt's last
    logits where the chunk finished it, else None)."""
    decoders = [prompt for prompt, _ in chunks]
    batches = [prompt.take_prompt(limit) for prompt, limit in chunks]
    rows, every, wanted = list(tokens), list(caches), list(range(len(tokens)))
    for prompt, batch in zip(decoders, batches):
        rows += batch
        every += [prompt.cache] * len(batch)
        if not prompt.pending:  # its prompt's last token: its logits start the generation
            wanted.append(len(rows) - 1)
    logits = forward_rows(model, rows, every, wanted)
    out, at = [], len(tokens)
    for prompt, batch in zip(decoders, batches):
        last = logits[at:at + 1] if not prompt.pending else None
        at += last is not None
        out.append(prompt._ran(batch, last))
    return logits[:len(tokens)], out
