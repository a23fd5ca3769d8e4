"""MRoPE (Qwen3-VL) in the engine: the interleaved axis of each rotary column, tables at three positions, and the
rotary offset a cache keeps after a prompt's images (`ModelCache.rope_delta`) in every decode path: one
sequence's fused decode plan (kernels/decode_layers) and the batched rows. The model-level parity with
transformers is tests/models/test_qwen3_vl_moe.py."""

from __future__ import annotations

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine.batch import forward_rows
from localmoe.engine.decode_plan import DecodePlan
from localmoe.engine.rope import RotaryTable, mrope_axes
from localmoe.load import load_model
from localmoe.testing import write_checkpoint


def test_axes_interleave_as_transformers_does():
    # transformers' Qwen3-VL: frequency j is height where j % 3 == 1 and j < 3 * 3, width where j % 3 == 2, j < 3 * 3
    assert mrope_axes(16, (2, 3, 3)).tolist() == [0, 1, 2, 0, 1, 2, 0, 1] * 2
    with pytest.raises(ValueError, match="summing to head_dim / 2 = 8"):
        mrope_axes(16, (2, 3, 2))


def test_tables_take_each_column_from_its_axis():
    table = RotaryTable(16, 10000.0, None, 64, mrope_section=(2, 3, 3))
    same = torch.tensor([[5, 6, 7]] * 3)
    cos, sin = table.at_mrope(same)
    want_cos, want_sin = table.at(torch.tensor([[5, 6, 7]]))
    assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)  # equal positions: plain RoPE
    cos, _ = table.at_mrope(torch.tensor([[5], [9], [30]]))
    axes = mrope_axes(16, (2, 3, 3))
    for d in range(16):
        assert cos[0, 0, 0, d] == table.cos[[5, 9, 30][axes[d]], d]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny", seed=0)
    return load_model(path, EngineConfig(threads=1), progress=False).model


def test_decode_paths_rotate_at_the_cache_position_plus_the_delta(gpt_oss):
    model = gpt_oss
    assert DecodePlan.build(model) is not None  # its single-sequence steps run the fused plan
    prompt = torch.randint(0, model.spec.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))

    def decoded(delta: int, fused: bool) -> torch.Tensor:
        cache = model.new_cache(1, 16)
        model.forward(prompt, cache)
        cache.rope_delta = delta  # as a prompt whose images saved 3 positions leaves it
        out = []
        for token in (3, 4, 5):
            out.append(model.forward(torch.tensor([[token]]), cache)[0, -1] if fused else
                       forward_rows(model, [token], [cache])[0])
        return torch.stack(out)

    fused, rows = decoded(-3, True), decoded(-3, False)
    span = (rows.max() - rows.min()).item()
    assert (fused - rows).abs().max().item() <= 1e-3 * span  # the two kernels round differently, nothing more
    assert (decoded(0, True) - fused).abs().max().item() > 1e-2 * span  # and the delta moves the positions
