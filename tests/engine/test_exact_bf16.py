"""fp32-requested weights whose values are exactly bf16 are stored as bf16 (engine/linear.py `holds_bf16`,
`Linear(compact=True)`; a layer's dense routed experts all together, engine/experts.py): the check is per tensor (per
layer for experts), and the model computes the same bits as with the fp32 copies."""

from __future__ import annotations

import threading

import pytest
import torch

from localmoe.config import EngineConfig
from localmoe.engine import linear as linear_module
from localmoe.engine.generate import prefill
from localmoe.engine.linear import Linear, holds_bf16
from localmoe.kernels import dense_gemv
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

needs_kernel = pytest.mark.skipif(not dense_gemv.kernel_available(), reason="needs the dense GEMV kernel")


def test_holds_bf16_is_checked_value_by_value():
    w = torch.randn(300, 200).bfloat16().float()
    assert holds_bf16(w) and holds_bf16(w.bfloat16())
    w.view(-1)[-1] = w.view(-1)[-1].item() + 2.0 ** -20  # one value off the bf16 grid (its low bits set)
    assert not holds_bf16(w)
    assert not holds_bf16(torch.randn(8, 8).half())


@needs_kernel
def test_only_exact_fp32_weights_are_stored_as_bf16():
    exact = torch.randn(64, 96).bfloat16().float()
    assert Linear(exact, None, "float32").weight.dtype == torch.bfloat16
    assert Linear(exact, None, "float32", compact=False).weight.dtype == torch.float32
    assert Linear(torch.randn(64, 96), None, "float32").weight.dtype == torch.float32
    x = torch.randn(3, 96)
    for rows in (1, 3, 40, 300):  # the GEMV kernel's row stream, tiles, and a prompt chunk's token blocks
        xs = torch.randn(rows, 96)
        assert torch.equal(Linear(exact, None, "float32")(xs), Linear(exact, None, "float32", compact=False)(xs))
    assert torch.equal(Linear(exact, None, "float32")(x), Linear(exact, None, "float32", compact=False)(x))
    big, out = torch.randn(40, 96), []

    def fresh_thread():  # its widening buffer made first inside inference mode, then a GEMM call outside it
        with torch.inference_mode():
            out.append(Linear(exact, None, "float32")(big))
        out.append(Linear(exact, None, "float32")(big))

    worker = threading.Thread(target=fresh_thread)
    worker.start()
    worker.join()
    assert len(out) == 2 and torch.equal(out[0], out[1])


def _dense_expert_dtypes(model) -> set:
    return {w.gate.weight.dtype for b in model.moe_blocks() for w in b.experts.experts[b.layer]
            if isinstance(w.gate.weight, torch.Tensor) and w.gate.weight.is_floating_point()}


@needs_kernel
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_dense_routed_experts_are_stored_as_linear_stores_weights(dtype, tmp_path):
    """Kimi-Linear's dense routed experts (a bf16 checkpoint): bf16 at dtype bfloat16 and, being exactly bf16, at
    float32 too, where they used to stay fp32 (twice the bytes a decode token reads); the kernels take them."""
    path = write_checkpoint("kimi_linear", tmp_path / "kimi_linear", size="tiny", seed=1)
    model = load_model(path, EngineConfig(dtype=dtype, max_context=64), progress=False).model
    assert _dense_expert_dtypes(model) == {torch.bfloat16}
    assert all(b.experts.dense_table(b.layer) is not None for b in model.moe_blocks())


@needs_kernel
@pytest.mark.parametrize("family", ["kimi_k3", "qwen3_next", "kimi_linear"])
def test_a_model_computes_the_same_bits(family, tmp_path, monkeypatch):
    """A bf16 checkpoint loaded at fp32: prompt logits at every position and 6 fused greedy steps, compact against
    fp32 copies (holds_bf16 patched to say no), bit for bit; and the compact model reads fewer weight bytes
    (Qwen3-Next's and Kimi-Linear's dense routed experts among them)."""
    path = write_checkpoint(family, tmp_path / family, size="tiny", seed=1)
    config = EngineConfig(dtype="float32", max_context=128, expert_precision="q8")

    def run():
        model = load_model(path, config, progress=False).model
        prompt = list(range(3, 40))
        everything = model.forward(torch.tensor([prompt]), model.new_cache(1, 128), all_logits=True)[0]
        cache = model.new_cache(1, 128)
        logits, steps = prefill(model, prompt, cache), []
        for _ in range(6):
            logits = model.forward(logits.argmax(-1).view(1, 1), cache)[:, -1]
            steps.append(logits)
        assert model._plan is not None  # the fused step ran
        return model.weight_bytes(), everything, torch.cat(steps), _dense_expert_dtypes(model)

    compact = run()
    monkeypatch.setattr(linear_module, "holds_bf16", lambda weight: False)
    full = run()
    if family != "kimi_k3":  # dense routed experts (K3's are MXFP4)
        assert compact[3] == {torch.bfloat16} and full[3] == {torch.float32}
    assert compact[0] < full[0]
    assert torch.equal(compact[1], full[1]) and torch.equal(compact[2], full[2])
