"""Running a packed store: the MoE families converted with `localmoe convert` load with their
routed experts left in the store and give exactly the logits of the HF directory they came from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.convert import convert
from localmoe.errors import CheckpointError, LocalMoEError
from localmoe.load import load_model
from localmoe.testing import write_checkpoint
from localmoe.testing.parity import random_tokens

FAMILIES = ["gpt_oss", "kimi_linear", "kimi_k3"]
CONFIG = EngineConfig(dtype="float32", threads=1)


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    src = write_checkpoint(request.param, root / "hf", "tiny", seed=1)
    convert(src, root / "store", experts="keep")  # bf16 experts stay bf16; MXFP4 ones are repacked losslessly
    return src, root / "store"


def test_store_logits_equal_the_hf_directory(converted):
    src, store = converted
    hf, packed = load_model(src, CONFIG, progress=False), load_model(store, CONFIG, progress=False)
    assert packed.model.weight_bytes() < hf.model.weight_bytes()  # the experts stay in the store
    tokens = random_tokens(24, seed=2, vocab=hf.spec.vocab_size)
    want = hf.model.forward(tokens, hf.model.new_cache(1, 32), all_logits=True)
    got = packed.model.forward(tokens, packed.model.new_cache(1, 32), all_logits=True)
    assert torch.equal(got, want)
    assert packed.tokenizer.encode("hello world") == hf.tokenizer.encode("hello world")


def test_quantised_store_stays_close_to_bf16_experts(tmp_path):
    """Kimi-Linear's bf16 experts become MXFP4 under the default conversion: logits move a little."""
    src = write_checkpoint("kimi_linear", tmp_path / "hf", "tiny", seed=1)
    convert(src, tmp_path / "store")
    hf, packed = load_model(src, CONFIG, progress=False), load_model(tmp_path / "store", CONFIG, progress=False)
    assert packed.model.moe_blocks()[0].experts.get(1, 0).gate.packed is not None
    tokens = random_tokens(24, seed=2, vocab=hf.spec.vocab_size)
    want = hf.model.forward(tokens, hf.model.new_cache(1, 32), all_logits=True)
    got = packed.model.forward(tokens, packed.model.new_cache(1, 32), all_logits=True)
    rel = ((got - want).abs().max() / (want.max() - want.min())).item()
    assert 0 < rel < 0.1, rel


def test_run_command_on_a_store(converted):
    _, store = converted
    done = subprocess.run([sys.executable, "-m", "localmoe", "run", "--model", str(store), "hi", "--max-tokens", "4",
                           "--temperature", "0"], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert "4 tokens" in done.stderr


def test_a_store_whose_manifest_is_gone_is_named(converted, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / ".progress.json").write_text(json.dumps({}))
    with pytest.raises(CheckpointError, match="did not finish"):
        load_model(broken, CONFIG, progress=False)


def test_a_dense_shard_that_lacks_a_tensor_is_named(converted, tmp_path):
    _, store = converted
    manifest = json.loads((store / "manifest.json").read_text())
    name = next(iter(manifest["dense"]["tensors"]))
    copy = tmp_path / "copy"
    copy.mkdir()
    for f in store.iterdir():
        if f.is_file():
            (copy / f.name).write_bytes(f.read_bytes())
    (copy / "experts").symlink_to(store / "experts")
    manifest["dense"]["tensors"].pop(name)  # the shard still holds it, but the store no longer lists it
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(LocalMoEError, match="missing"):
        load_model(copy, CONFIG, progress=False)
