"""The sampler against distributions computed independently in float64 numpy."""

import numpy as np
import pytest
import torch

from localmoe.engine.sampler import SamplingParams, apply_repetition_penalty, filter_logits, sample
from localmoe.errors import LocalMoEError


def _softmax(x):
    e = np.exp(x - x.max())
    return e / e.sum()


def _draw(logits, params, n=4000):
    generator = params.make_generator()
    batch = torch.tensor(logits, dtype=torch.float32).expand(n, -1).contiguous()
    return np.bincount(sample(batch, params, generator).numpy(), minlength=len(logits)) / n


LOGITS = np.array([2.0, 1.5, 1.0, 0.2, -0.5, -3.0, 0.9, 1.7])


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits, SamplingParams(temperature=0)), logits.argmax(-1))


def test_seed_reproduces_and_differs_across_seeds():
    logits = torch.randn(1, 1000).expand(64, -1)
    a = sample(logits, SamplingParams(seed=7), SamplingParams(seed=7).make_generator())
    b = sample(logits, SamplingParams(seed=7), SamplingParams(seed=7).make_generator())
    c = sample(logits, SamplingParams(seed=8), SamplingParams(seed=8).make_generator())
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_frequencies_follow_softmax_of_scaled_logits(temperature):
    freq = _draw(LOGITS, SamplingParams(temperature=temperature, seed=1))
    expected = _softmax(LOGITS / temperature)
    assert np.abs(freq - expected).max() < 0.03


def test_top_k_keeps_only_k_best():
    freq = _draw(LOGITS, SamplingParams(temperature=1.0, top_k=3, seed=2))
    best = np.argsort(-LOGITS)[:3]
    expected = np.zeros_like(LOGITS)
    expected[best] = _softmax(LOGITS[best])
    assert set(np.flatnonzero(freq)) <= set(best)
    assert np.abs(freq - expected).max() < 0.03


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
    probs = _softmax(LOGITS)
    order = np.argsort(-probs)
    cumulative = np.cumsum(probs[order])
    kept = order[: int(np.searchsorted(cumulative, top_p) + 1)]  # first index where the mass reaches top_p
    filtered = filter_logits(torch.tensor(LOGITS[None], dtype=torch.float32), 0, top_p, 0.0)[0]
    assert set(np.flatnonzero(torch.isfinite(filtered).numpy())) == set(kept)


def test_min_p_drops_tokens_below_fraction_of_best():
    probs = _softmax(LOGITS)
    filtered = filter_logits(torch.tensor(LOGITS[None], dtype=torch.float32), 0, 1.0, 0.3)[0]
    assert set(np.flatnonzero(torch.isfinite(filtered).numpy())) == set(np.flatnonzero(probs >= 0.3 * probs.max()))


def test_repetition_penalty_ctrl_rule():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.25]])
    out = apply_repetition_penalty(logits, torch.tensor([[0, 1, 1]]), 2.0)
    assert torch.equal(out, torch.tensor([[1.0, -2.0, 0.5, -0.25]]))


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.9]])
    params = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(logits, params, history=torch.tensor([[0]])).item() == 1


@pytest.mark.parametrize("bad", [{"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"top_k": -2},
                                 {"min_p": 2}, {"repetition_penalty": 0}])
def test_invalid_parameters_are_rejected(bad):
    with pytest.raises(LocalMoEError):
        SamplingParams(**bad)
