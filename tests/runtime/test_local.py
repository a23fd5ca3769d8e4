"""The Python API (`localmoe.load()` -> runtime/local.py `LocalModel`) runs the runtime's chat turn:
a thinking budget closes the reasoning and the reasoning streams apart from the answer; closing a
stream early cancels the job and frees its cache."""

from __future__ import annotations

import pytest

from localmoe.chat.budget import ThinkingBudgets
from localmoe.engine.sampler import SamplingParams
from localmoe.runtime.local import LocalModel
from localmoe.runtime.service import ServerConfig

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint

    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=0)
    return LocalModel(load_model(path, EngineConfig(), progress=False),
                      ServerConfig(budgets=ThinkingBudgets(low=3), prefix_cache_entries=0))


def test_thinking_budget_and_reasoning_from_python(gpt_oss):
    chunks = list(gpt_oss.stream("Think, then answer.", GREEDY, max_tokens=24, thinking="low"))
    result = chunks[-1].result
    assert result.reasoning_closed_by == "reasoning_tokens" and result.reasoning_tokens == 3
    assert "".join(c.reasoning for c in chunks) == result.reasoning
    assert "".join(c.text for c in chunks) == result.content
    again = gpt_oss.generate("Think, then answer.", GREEDY, max_tokens=24, thinking="low")
    assert (again.content, again.reasoning) == (result.content, result.reasoning)


def test_closing_a_stream_cancels_and_frees_its_cache():
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    embedded = LocalModel(load_model(None, EngineConfig(threads=1), progress=False))
    stream = embedded.stream("Tell a long story.", GREEDY, max_tokens=64)
    assert next(stream).text
    worker = embedded.service.worker
    assert worker.active == 1 and worker.kv_bytes > 0
    stream.close()
    assert worker.active == 0 and worker.kv_bytes == 0
