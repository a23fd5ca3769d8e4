"""gpt-oss from a llama.cpp-layout GGUF (MXFP4 experts as ggml blocks, gate / up split, `gpt-oss.*`
metadata) against the HF checkpoint it was written from. The HF path is itself checked against
transformers (test_gpt_oss.py), so equal bits here tie the GGUF path to that reference too."""

from __future__ import annotations

import pytest
import torch

from localmoe.engine.decode_plan import DecodePlan
from localmoe.errors import CheckpointError
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.gpt_oss_gguf import write_gguf

PROMPT = torch.tensor([[5, 17, 3, 99, 42, 7, 250, 11]])


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss_gguf")
    src = write_checkpoint("gpt_oss", root / "src", size="tiny", seed=1)
    return src, write_gguf(src, root / "tiny.gguf")


def _greedy(model, steps: int = 6) -> list[torch.Tensor]:
    cache = model.new_cache(1, PROMPT.shape[1] + steps + 1)
    out = [model.forward(PROMPT, cache, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward(out[-1][:, -1:].argmax(-1), cache))
    return out


@pytest.mark.parametrize("precision", ["exact", "q8"])
def test_gguf_gives_the_hf_checkpoints_bits(files, precision):
    """Same spec (YaRN truncate=False, alternating sliding layers, float32 metadata read back as the
    config's decimals), same expert bytes after moving nibbles, so prefill and every decode step are
    bit-identical, both through the one-call decode plan."""
    src, gguf = files
    hf = load_model(src, dtype="float32", expert_precision=precision, progress=False)
    ours = load_model(gguf, dtype="float32", expert_precision=precision, progress=False)
    assert ours.spec == hf.spec
    for step, (a, b) in enumerate(zip(_greedy(ours.model), _greedy(hf.model))):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"
    assert isinstance(ours.model._plan, DecodePlan)
    text = "The capital of France is Paris, 2026."
    assert ours.tokenizer.encode(text) == hf.tokenizer.encode(text)


def test_experts_stay_mxfp4_bytes(files):
    gguf = files[1]
    block = load_model(gguf, dtype="float32", progress=False).model.moe_blocks()[0]
    table = block.experts.kernel_table(block.layer)
    assert table is not None  # every expert in the MoE kernel's form: contiguous canonical bytes
    w = block.experts.get(block.layer, 0)
    assert w.gate.packed.dtype == torch.uint8 and w.gate.weight is None


def test_missing_expert_tensor_is_named(files, tmp_path):
    """A GGUF without one layer's down experts fails naming the canonical tensor and the file."""
    src, _ = files
    broken = write_gguf(src, tmp_path / "broken.gguf", omit=("blk.1.ffn_down_exps.weight",))
    with pytest.raises(CheckpointError, match=r"broken\.gguf: tensor 'layers\.1\.mlp\.experts\.down_proj\.packed' is "
                                              r"missing"):
        load_model(broken, dtype="float32", progress=False)


@pytest.mark.parametrize("ram", [0, "25%"])
def test_store_converted_from_the_gguf_pages_its_experts(files, tmp_path, ram):
    """`localmoe convert model.gguf` splits the ggml MXFP4 experts into canonical extents, so the store
    runs with its experts paged (resident maps, or a RAM tier of a quarter of them) and gives the
    HF checkpoint's bits."""
    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.convert import convert
    from localmoe.paging import Pager, expert_bytes
    from localmoe.store.packed import PackedStore

    src, gguf = files
    convert(gguf, tmp_path / "store", progress=False)
    store = PackedStore(tmp_path / "store")
    assert store.layers() == [0, 1, 2, 3] and len(store.experts_in(0)) == 8
    budget = 0 if ram == 0 else expert_bytes(store) // 4
    ours = load_model(tmp_path / "store", EngineConfig(dtype="float32", expert_precision="exact", paging=PagingConfig(ram_budget=budget)),
                      progress=False)
    hf = load_model(src, dtype="float32", expert_precision="exact", progress=False)
    assert isinstance(ours.model.moe_blocks()[0].experts, Pager) == (ram != 0)
    for step, (a, b) in enumerate(zip(_greedy(ours.model), _greedy(hf.model))):
        assert torch.equal(a, b), f"step {step}: max diff {(a - b).abs().max().item():.3e}"
    assert ours.tokenizer.encode("Hello world") == hf.tokenizer.encode("Hello world")

