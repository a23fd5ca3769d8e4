"""Shared fixtures."""

import sys

import pytest

# transformers runs flash-linear-attention's Triton kernels in its Kimi-Linear / Qwen3-Next layers whenever
# `fla` imports (our `gpu` extra), whatever the device; the parity tests run those references on the CPU,
# where fla's kernels have no driver. So fla stays hidden here; tests/kernels/test_fla_ops.py lifts it.
sys.modules.setdefault("fla", None)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (the embedded default), fetched on first use."""
    from localmoe.default_model import default_model_path

    return default_model_path()
