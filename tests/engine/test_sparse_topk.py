"""`sparse_topk` on dense MLA (Kimi-Linear's MLA layer) and GQA (Qwen3-Next's gated attention):
exactly dense at top-k >= the context, a real selection below it."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.sparse_topk import keep_topk_scores
from localmoe.errors import LocalMoEError
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import random_tokens

T = 48


@pytest.fixture(scope="module", params=["kimi_linear", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    return write_checkpoint(request.param, tmp_path_factory.mktemp(request.param), "tiny", seed=0)


def run(path, sparse_topk):
    model = load_model(path, EngineConfig(dtype="float32", threads=1, sparse_topk=sparse_topk), progress=False).model
    tokens = random_tokens(T, 7, model.spec.vocab_size)
    cache = model.new_cache(1, T + 4)
    prefill = model.forward(tokens[:, :T - 4], cache, all_logits=True)
    decode = [model.forward(tokens[:, t:t + 1], cache) for t in range(T - 4, T)]
    return torch.cat([prefill, *decode], dim=1)


def test_topk_at_or_above_the_context_equals_dense_exactly(checkpoint):
    dense = run(checkpoint, None)
    assert torch.equal(run(checkpoint, T), dense)
    assert torch.equal(run(checkpoint, 10 * T), dense)


def test_topk_below_the_context_selects(checkpoint):
    dense, sparse = run(checkpoint, None), run(checkpoint, 8)
    torch.testing.assert_close(sparse[:, :8], dense[:, :8], rtol=1e-5, atol=1e-5)  # queries seeing <= 8 keys
    assert (sparse[:, 8:] - dense[:, 8:]).abs().max() > 1e-4


def test_keep_topk_scores_renormalises_over_the_best_keys():
    scores = torch.tensor([[0.5, 3.0, -1.0, 2.0, float("-inf")]])
    kept = keep_topk_scores(scores, 2)
    assert kept.isinf().sum() == 3 and kept[0, 1] == 3.0 and kept[0, 3] == 2.0
    p = kept.softmax(-1)
    torch.testing.assert_close(p[0, [1, 3]], torch.tensor([3.0, 2.0]).softmax(-1))


def test_non_positive_sparse_topk_is_refused():
    with pytest.raises(LocalMoEError, match="--sparse-topk"):
        EngineConfig(sparse_topk=0)
