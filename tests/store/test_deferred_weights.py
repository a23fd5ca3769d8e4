"""Loading converts large floating checkpoint tensors to fp32 when the model builder takes them
(localmoe/weights.py), not all at once: the same values as converting up front, tied weights stay
one tensor, and the load's peak memory drops (measured in fresh processes)."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.load import load_model
from localmoe.testing.write import write_checkpoint
from localmoe.weights import MIN_DEFERRED_ELEMENTS, Deferred, Weights, convert


def _transpose(t: torch.Tensor, spec) -> torch.Tensor:
    return t.T.contiguous() * 2


def _data_dependent(t: torch.Tensor, spec) -> torch.Tensor:
    return t[:, : int(t[0, 0].abs().item() > -1) + 3]  # needs the data: cannot run on meta


def test_large_floats_are_deferred_with_their_transformed_shape():
    source = torch.randn(512, 256).to(torch.bfloat16)
    deferred = convert(source, _transpose, None)
    assert isinstance(deferred, Deferred) and deferred.shape == (256, 512)
    assert torch.equal(deferred.take(), _transpose(source.float(), None))
    eager = convert(source, _data_dependent, None)  # the transform needs the data: converted now
    assert isinstance(eager, torch.Tensor) and eager.dtype == torch.float32 and eager.shape == (512, 4)
    small = convert(torch.ones(8, 8, dtype=torch.bfloat16), None, None)
    assert isinstance(small, torch.Tensor) and small.dtype == torch.float32
    codes = convert(torch.zeros(1024, 1024, dtype=torch.uint8), None, None)  # MXFP4 bytes stay bytes
    assert codes.dtype == torch.uint8
    assert 512 * 256 >= MIN_DEFERRED_ELEMENTS


def test_weights_take_once_while_alive_and_never_convert_everything():
    weights = Weights(a=convert(torch.randn(512, 256), None, None), b=torch.ones(4))
    assert weights.shape("a") == (512, 256) and weights.shape("b") == (4,)
    first = weights["a"]
    assert weights.get("a") is first  # tied uses share one tensor while it lives
    values = first.clone()
    del first
    gc.collect()
    again = weights.pop("a")  # converted afresh: the first copy is gone
    assert torch.equal(again, values) and "a" not in weights
    with pytest.raises(TypeError, match="iterate the names"):
        weights.items()
    with pytest.raises(TypeError, match="iterate the names"):
        weights.values()


def test_same_logits_as_converting_up_front(tmp_path_factory, monkeypatch):
    path = write_checkpoint("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), "tiny")
    tokens = torch.tensor([[3, 14, 15, 92, 65]])

    def logits():
        model = load_model(path, EngineConfig(dtype="bfloat16", threads=1)).model
        return model.forward(tokens, model.new_cache(1, 8), all_logits=True)

    deferred = logits()
    monkeypatch.setattr("localmoe.weights.MIN_DEFERRED_ELEMENTS", 1 << 62)  # everything converted up front
    assert torch.equal(deferred, logits())


PEAK = """
import json, sys
import localmoe.weights
from localmoe.config import EngineConfig
from localmoe.load import load_model
if sys.argv[2] == "eager":
    localmoe.weights.MIN_DEFERRED_ELEMENTS = 1 << 62
def kib(key):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(key))
model = load_model(sys.argv[1], EngineConfig(dtype="bfloat16", threads=1), progress=False)
print(json.dumps({"peak": kib("VmHWM") * 1024, "after": kib("VmRSS") * 1024}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_bf16_load_peak_stays_near_what_the_model_holds(tmp_path_factory):
    """Kimi K3 `small` in bf16 (its dense matrices and bf16 experts, ~270 MB): up front, the fp32
    copies of every matrix existed at once (measured 250 MiB over the loaded model); deferred, each
    lives only while its layer is built (measured 0 MiB over)."""
    path = write_checkpoint("kimi_k3", tmp_path_factory.mktemp("kimi_k3_small"), "small")

    def over_final(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", PEAK, str(path), mode], capture_output=True, text=True, check=True)
        figures = json.loads(run.stdout.strip().splitlines()[-1])
        return figures["peak"] - figures["after"]

    eager, deferred = over_final("eager"), over_final("deferred")
    assert eager > 150 << 20, f"the up-front load peaked only {eager >> 20} MiB over the loaded model"
    assert deferred < 48 << 20, f"deferred {deferred >> 20} MiB over the loaded model, up front {eager >> 20} MiB"


def test_gguf_half_floats_come_as_zero_copy_views_and_are_deferred():
    """F16 / BF16 GGUF tensors are views of the file's bytes, converted when the builder takes them."""
    from gguf import GGMLQuantizationType

    from localmoe.load import _ggml_tensor

    for ggml_type, dtype in ((GGMLQuantizationType.BF16, torch.bfloat16), (GGMLQuantizationType.F16, torch.float16)):
        values = torch.randn(512, 256).to(dtype)
        raw = values.view(torch.uint8).reshape(-1)
        tensor = _ggml_tensor(raw, ggml_type, (512, 256), keep=False, where="test")
        assert tensor.dtype == dtype and tensor.data_ptr() == raw.data_ptr()
        deferred = convert(tensor, None, None)
        assert isinstance(deferred, Deferred) and torch.equal(deferred.take(), values.float())
