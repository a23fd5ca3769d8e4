"""Kernel tests: Triton kernels run on CPU tensors through the interpreter where CUDA is absent.

TRITON_INTERPRET must be set before triton is first imported, hence here, at collection.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAVE_TRITON = importlib.util.find_spec("triton") is not None
# Triton cases: CPU tensors under the interpreter, and CUDA where present.
TRITON_DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
                                                 reason="needs triton with TRITON_INTERPRET=1"), id="interp"),
    pytest.param("cuda", marks=pytest.mark.skipif(not HAVE_TRITON or not torch.cuda.is_available(),
                                                  reason="needs triton and CUDA"), id="cuda"),
]


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over all elements, in float64 (0 when both are 0)."""
    got, want = got.double().cpu(), want.double().cpu()
    den = want.norm().item()
    num = (got - want).norm().item()
    return num / den if den > 0 else num


def assert_close(got: torch.Tensor, want: torch.Tensor, tol: float, name: str = "") -> None:
    """Relative-RMS closeness, with NaN/Inf required at the same places."""
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    bad_g, bad_w = ~torch.isfinite(got.cpu()), ~torch.isfinite(want.cpu())
    assert torch.equal(bad_g, bad_w), f"{name}: non-finite values at different places"
    err = rel_rms(got.cpu()[~bad_w], want.cpu()[~bad_w])
    assert err <= tol, f"{name}: relative RMS error {err:.3e} > {tol:.1e}"


def pytest_configure(config):
    config.kernel_helpers = (rel_rms, assert_close)


@pytest.fixture
def close():
    """assert_close(got, want, tol, name)."""
    return assert_close


def greedy_logits(model, prompt: list[int], steps: int, planned: bool, max_len: int,
                  every_step: bool = False) -> torch.Tensor:
    """Logits [steps, V] of `steps` greedy decode steps after `prompt`; `planned`: through the model's decode
    plan (checked to be the hybrid one; `every_step`: checked to have run every step), else op by op (the
    plan's step declined)."""
    from localmoe.kernels.decode_layers.hybrid import HybridDecoder

    model._plan = None
    if not planned:
        model._planned_step = lambda tokens, cache: None
    calls, call = [], HybridDecoder.__call__
    HybridDecoder.__call__ = lambda self, *args: calls.append(1) or call(self, *args)
    try:
        cache = model.new_cache(1, max_len)
        logits = model.forward(torch.tensor([prompt]), cache)
        out = []
        for _ in range(steps):
            logits = model.forward(logits[:, -1].argmax(-1, keepdim=True), cache)
            out.append(logits[0, -1])
    finally:
        HybridDecoder.__call__ = call
    if planned:
        assert type(model._plan.decoder).__name__ == "HybridDecoder"
        assert not every_step or len(calls) == steps, f"{len(calls)} of {steps} steps ran fused"
    else:
        del model._planned_step
    return torch.stack(out)
