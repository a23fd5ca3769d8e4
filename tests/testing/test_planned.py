"""PlannedCheckpoint: the tensors write_checkpoint writes, computed on demand (benchmarks/gguf_moe.py writes a `large`
model's GGUF from them without ~10 GB of shards on disk)."""

from __future__ import annotations

import torch

from localmoe.store.safetensors import SafetensorsCheckpoint
from localmoe.testing import write_checkpoint
from localmoe.testing.moe_gguf import write_moe_gguf
from localmoe.testing.planned import PlannedCheckpoint


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def test_planned_tensors_are_the_written_ones_and_give_the_same_gguf(tmp_path):
    written = write_checkpoint("qwen3_moe", tmp_path / "a" / "m", "tiny", seed=3)
    bare = write_checkpoint("qwen3_moe", tmp_path / "b" / "m", "tiny", seed=3, weights=False)
    assert not list(bare.glob("*.safetensors")) and (bare / "config.json").exists()
    real, planned = SafetensorsCheckpoint(written), PlannedCheckpoint("qwen3_moe", "tiny", seed=3)
    assert sorted(real.keys()) == sorted(planned.keys())
    for name in real.keys():
        a, b = real.tensor(name), planned.tensor(name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b)), name
    one = write_moe_gguf(written, tmp_path / "a" / "x.gguf", "q4_k_m")
    two = write_moe_gguf(bare, tmp_path / "b" / "x.gguf", "q4_k_m", ckpt=planned)
    assert one.read_bytes() == two.read_bytes()
    assert not torch.equal(_bytes(planned.tensor("model.embed_tokens.weight")),
                           _bytes(PlannedCheckpoint("qwen3_moe", "tiny", seed=4).tensor("model.embed_tokens.weight")))
