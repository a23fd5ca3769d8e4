"""The sampler is safe for every finite setting: no nan, no error, a valid token id."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.sampler import SamplingParams, sample
from localmoe.errors import LocalMoEError

TINY, HUGE = 1e-300, 1e300


@pytest.mark.parametrize("temperature", [TINY, 5e-324, 1e-8, 0.7, 2.0, HUGE])
@pytest.mark.parametrize("penalty", [TINY, 1.0, 10.0, HUGE])
@pytest.mark.parametrize("top_p, min_p, top_k", [(1.0, 0.0, 0), (TINY, 0.0, 0), (1.0, 1.0, 0), (0.5, TINY, 3)])
def test_extreme_but_finite_settings_sample_a_valid_token(temperature, penalty, top_p, min_p, top_k):
    big = torch.finfo(torch.float32).max
    logits = torch.tensor([[3.0, -2.0, big, -big, 0.0, 1e-30, 7.5, big / 2]])
    history = torch.tensor([[0, 1, 2, 3, 7]])
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                            repetition_penalty=penalty, seed=1)
    token = int(sample(logits, params, params.make_generator(), history))
    assert 0 <= token < logits.shape[-1]
    if temperature <= 1e-8 and penalty == 1.0:  # next to greedy: the best logit
        assert token == 2


def test_tiny_temperature_is_effectively_greedy():
    logits = torch.tensor([[0.1, 5.0, 4.999, -1.0]])
    params = SamplingParams(temperature=TINY, seed=0)
    assert {int(sample(logits, params, params.make_generator())) for _ in range(20)} == {1}


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repetition_penalty"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_settings_are_refused(field, value):
    with pytest.raises(LocalMoEError, match="finite"):
        SamplingParams(**{field: value})
