"""`localmoe probe-recall` on the tiny DeepSeek-V3.2 checkpoint (DSA layers) and a dense one
under `sparse_topk`: needle placement, per-layer recall of the needle's tokens, the CLI."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from localmoe.commands.probe_recall import command, probe
from localmoe.config import EngineConfig
from localmoe.errors import LocalMoEError
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

CONTEXT = 160


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint("deepseek_v32", tmp_path_factory.mktemp("dsv32"), "tiny", seed=0)


def with_topk(checkpoint, tmp_path, top_k):
    path = tmp_path / f"topk{top_k}"
    shutil.copytree(checkpoint, path)
    config = json.loads((path / "config.json").read_text())
    config["index_topk"] = top_k
    (path / "config.json").write_text(json.dumps(config))
    return load_model(path, EngineConfig(dtype="float32", threads=1, max_context=512), progress=False)


def test_topk_above_the_prompt_selects_the_needle_everywhere(checkpoint, tmp_path):
    loaded = with_topk(checkpoint, tmp_path, 4096)
    results = probe(loaded, [0.25, 0.75], CONTEXT, max_tokens=2)
    for result in results:
        assert set(result.recall) == {f"layer {i}" for i in range(4)}
        assert all(share == 1.0 for share in result.recall.values())
    # the needle sits where it was asked for: later depth, later position
    assert results[0].needle_positions[0] < results[1].needle_positions[0]


def test_topk_of_one_keeps_at_most_one_needle_token(checkpoint, tmp_path):
    loaded = with_topk(checkpoint, tmp_path, 1)
    result = probe(loaded, [0.5], CONTEXT, max_tokens=1)[0]
    needle = len(result.needle_positions)
    assert needle >= 1
    assert all(share <= 1 / needle for share in result.recall.values())


def test_dense_model_needs_sparse_topk(tmp_path):
    path = write_checkpoint("qwen3_next", tmp_path / "q", "tiny", seed=0)
    with pytest.raises(LocalMoEError, match="--sparse-topk"):
        probe(load_model(path, EngineConfig(dtype="float32", threads=1), progress=False), [0.5], CONTEXT)
    sparse = load_model(path, EngineConfig(dtype="float32", threads=1, sparse_topk=4), progress=False)
    result = probe(sparse, [0.5], CONTEXT, max_tokens=1)[0]
    assert list(result.recall) == ["layer 3"]  # its one full-attention layer; delta layers select nothing
    assert 0.0 <= result.recall["layer 3"] <= 1.0


def test_command_prints_json(checkpoint):
    out = CliRunner().invoke(command, ["-m", str(checkpoint), "--depths", "0.5", "--context", str(CONTEXT),
                                       "--max-tokens", "1", "--threads", "1", "--json"])
    assert out.exit_code == 0, out.output
    results = json.loads(out.stdout)
    assert len(results) == 1 and results[0]["depth"] == 0.5 and len(results[0]["recall"]) == 4


def test_bad_depth_is_refused(checkpoint, tmp_path):
    with pytest.raises(LocalMoEError, match="outside 0..1"):
        probe(with_topk(checkpoint, tmp_path, 4), [1.5], CONTEXT)
