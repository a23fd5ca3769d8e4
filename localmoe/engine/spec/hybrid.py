"""`LookupThenModel`: prompt lookup where the answer quotes the sequence, a draft model elsewhere (`--spec
prompt+draft:PATH`).

Prompt lookup's drafts after a long match are a quote in progress and mostly kept whole (on the paged document task
nearly all of those after 8+ matched tokens), and they cost nothing to make; a draft model guesses the words around
the quotes, where lookup has nothing or a short, mostly rejected match. Each step takes the lookup's draft where its
match is at least `long` tokens (and of a class the speculator says pays: `least`), else the draft model's. The
drafts carry their class as each drafter's do (`Draft.match`: the lookup's match length; 0 for the model's), so the
speculator prices each class by its own acceptance (`mixed`: class 0, the model's, beside the lookup's 1..4), tries
the lookup's unpaid classes in the shadow (`shadow`) and keeps the draft model's thread off the step's clock
(`follow`, `thread_seconds`, `waited`). On a step the lookup drafts, the draft model's thread catches up on the
sequence and the lookup's draft beside the verify (the branch where every draft is kept), so where the quote ends it
is near the sequence's end and drafts after a few rows of catch-up at most.

Where it pays (docs/performance.md, session 17: the paged SmolLM2 MoE, its dense parent as the draft model): where the
draft model drafts little, the lookup's drafts carry it (a code edit: the model's first draft rejected, it priced
itself out, 1.00 tokens a step; the hybrid 2.04-2.12 at 89% kept, ahead of it in both runs); where the draft model
predicts the answer well, the lookup's drafts after 4-7 matched tokens are kept about half the time against the
model's 90%, so it trails the draft model alone (the document question, 8 runs of 9). Hence an option of its own,
not what `--spec draft:` runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from localmoe.engine.sampler import SamplingParams
from localmoe.engine.spec.draft_model import DraftModel
from localmoe.engine.spec.drafters import Draft, PromptLookup

LONG = 4  # the shortest match whose lookup draft is taken over the model's (8 measured no better: session 17)


class LookupThenModel:
    """A prompt lookup and a draft model behind one drafter (the module docstring)."""

    name = "prompt+draft"
    matches = deterministic = mixed = True  # (not `free`: declining runs the draft model's catch-up)

    def __init__(self, lookup: PromptLookup, model: DraftModel, long: int = LONG):
        if long < 1:
            raise ValueError(f"a lookup draft needs a match of at least 1 token, not {long}")
        self.lookup, self.model, self.long = lookup, model, long
        self.ahead = model.ahead
        self.caught_up = 0  # the draft model's catch-up of this step (0 where the lookup drafted)
        self.lookups = 0  # steps the lookup's draft was taken (tests and benchmarks count them)

    @property
    def _mlen(self) -> list[int]:  # the lookup's match length per key (the speculator's shadow tries read it)
        return self.lookup._mlen

    def shadow(self, i: int, k: int) -> tuple[int, int] | None:
        return self.lookup.shadow(i, k)

    def follow(self, history: Sequence[int]) -> None:
        self.model.follow(history)

    def thread_seconds(self) -> float:
        return self.model.thread_seconds()

    @property
    def waited(self) -> float:
        return self.model.waited

    def propose(self, history: Sequence[int], k: int, params: SamplingParams,
                generator: torch.Generator | None = None, least: int = 1) -> Draft:
        draft = self.lookup.propose(history, k, params, generator, least=max(least, self.long))
        if draft.tokens:
            self.lookups += 1
            self.caught_up = 0
            self.model.catch_up(list(history) + draft.tokens)  # beside the verify
            return draft
        draft = self.model.propose(history, k, params, generator)
        self.caught_up = self.model.caught_up
        return draft
