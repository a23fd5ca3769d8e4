"""Speculative sampling leaves the output distribution unchanged: chi-square tests over >= 2,000 draws
at a fixed context of a tiny model, for a deterministic drafter (prompt lookup's one-hot q) and a drafter
with its own distribution q, at the first and the second generated position; a biased rule (keep every
draft) fails the same test, so the test can tell."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from localmoe.engine.generate import Decoder
from localmoe.engine.sampler import SamplingParams, probabilities
from localmoe.engine.spec import accept as accept_module
from localmoe.engine.spec.drafters import Draft
from localmoe.engine.spec.speculator import Speculator

from .conftest import build_model

DRAWS = 2000
ALPHA = 1e-4  # fixed seeds, so a pass is reproducible; a biased rule scores p < 1e-6 (test_a_biased_rule_fails)
PARAMS = {"temperature": 1.0, "top_k": 4}  # a small support (the tiny model is nearly flat): bins of ~25%


class Fixed:
    """Drafts the same tokens every step (one-hot q, like prompt lookup)."""

    name = "fixed"

    def __init__(self, tokens):
        self.tokens = tokens

    def propose(self, history, k, params, generator):
        return Draft(self.tokens[:k])


class Sampled:
    """Drafts from a fixed distribution q (like a draft model that ignores the context)."""

    name = "sampled"

    def __init__(self, q: torch.Tensor):
        self.q = q

    def propose(self, history, k, params, generator):
        tokens = torch.multinomial(self.q, k, replacement=True, generator=generator).tolist()
        return Draft(tokens, self.q.expand(k, -1))


def chi_square_p(counts: Counter, probs: torch.Tensor, n: int) -> float:
    """p-value of the counts under `probs` (Pearson's chi-square; bins expected < 5 times pooled)."""
    expected = probs.double() * n
    big = (expected >= 5).nonzero().flatten().tolist()
    observed = [counts.get(t, 0) for t in big] + [n - sum(counts.get(t, 0) for t in big)]
    wanted = [float(expected[t]) for t in big] + [n - float(expected[big].sum())]
    if wanted[-1] < 5:  # pool the rest into the last big bin
        observed[-2] += observed.pop()
        wanted[-2] += wanted.pop()
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, wanted))
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model("llama", tmp_path_factory.mktemp("llama"))


def target_probs(model, context) -> torch.Tensor:
    dec = Decoder(model, context, SamplingParams(**PARAMS))
    logits = dec.logits()
    return probabilities(logits, dec.params)[0]


def draws(model, prompt, drafter, n: int = DRAWS) -> list[tuple[int, int]]:
    """The first two tokens after `prompt` of n speculative runs (one verify step of k = 2 drafts)."""
    out = []
    for seed in range(n):
        spec = Speculator(drafter, k=2, adaptive=False)
        dec = Decoder(model, prompt[:-1], SamplingParams(**PARAMS, seed=seed), speculator=spec)
        dec.logits()  # the prefill's (plain) logits: the context is fixed instead
        dec.feed(prompt[-1:])
        first = dec.sample(dec.logits())  # the verify step
        dec.feed([first])
        out.append((first, dec.sample(dec.logits())))
    return out


PROMPT = [5, 17, 3, 42, 7, 11, 60, 2]


@pytest.mark.parametrize("kind", ["one-hot", "sampled"])
def test_distribution_unchanged(model, kind):
    p1 = target_probs(model, PROMPT)
    likely, unlikely = int(p1.argmax()), int(p1.argsort()[-4])  # kept often; kept rarely
    if kind == "one-hot":
        drafter = Fixed([likely, unlikely])
    else:
        q = torch.zeros_like(p1)
        q[p1.argsort()[-6:]] = 1.0  # uniform over the target's 6 best tokens: q differs from p
        drafter = Sampled(q / q.sum())
    pairs = draws(model, PROMPT, drafter)
    firsts = Counter(a for a, _ in pairs)
    assert chi_square_p(firsts, p1, DRAWS) > ALPHA
    # the second token, where the first was `likely`, against the target at that context
    seconds = Counter(b for a, b in pairs if a == likely)
    n = sum(seconds.values())
    assert n >= 300
    assert chi_square_p(seconds, target_probs(model, PROMPT + [likely]), n) > ALPHA


def test_a_biased_rule_fails(model, monkeypatch):
    """Keeping every draft (no rejection) changes the distribution, and the test sees it."""
    def keep_all(drafts, q, p, generator):
        return len(drafts), int(torch.multinomial(p(len(drafts)), 1, generator=generator))

    monkeypatch.setattr(accept_module, "accept_sampled", keep_all)
    from localmoe.engine.spec import verify

    monkeypatch.setattr(verify, "accept_sampled", keep_all)
    p1 = target_probs(model, PROMPT)
    pairs = draws(model, PROMPT, Fixed([int(p1.argsort()[-2]), 0]), n=400)
    assert chi_square_p(Counter(a for a, _ in pairs), p1, 400) < 1e-6
