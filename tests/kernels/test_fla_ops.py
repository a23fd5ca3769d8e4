"""KDA / Gated DeltaNet through flash-linear-attention: the argument mapping (fla_ops.fla_arguments) checked
on the CPU through fla's own naive references, the dispatchers' choice of fla on CUDA tensors (fla faked on
the CPU), and, with CUDA and fla-core, fla's kernels against our references."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels import gated_delta as gdn_dispatch
from localmoe.kernels import kda as kda_dispatch
from localmoe.kernels.gated_delta.reference import naive_recurrent_gated_delta
from localmoe.kernels.kda import fla_ops
from localmoe.kernels.kda.reference import naive_recurrent_kda

try:
    HAVE_FLA = bool(importlib.metadata.version("fla-core"))
except importlib.metadata.PackageNotFoundError:
    HAVE_FLA = False
needs_fla = pytest.mark.skipif(not HAVE_FLA, reason="needs fla-core (the gpu extra)")


@pytest.fixture
def real_fla(monkeypatch):
    """fla importable for one test (tests/conftest.py hides it from transformers' CPU references)."""
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    fla_ops.ops.cache_clear()
    yield
    fla_ops.ops.cache_clear()


def _inputs(B, T, H, K, V, per_head: bool, seed: int = 0, bounded: bool = False):
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    gate = torch.rand(B, T, H, *(() if per_head else (K,)), generator=g_)
    g = -5.0 * torch.sigmoid(gate * 4 - 2) if bounded else -gate * 0.5  # bounded: K3's -5 * sigmoid(...)
    beta = torch.rand(B, T, H, generator=g_)
    state = torch.randn(B, H, K, V, generator=g_) * 0.1
    return q, k, v, g, beta, state


def _ours(op, q, k, v, g, beta, state):
    return (naive_recurrent_gated_delta if "gated_delta" in op else naive_recurrent_kda)(q, k, v, g, beta, state)


def _fla_naive(op: str):
    """fla's plain-torch reference of `op` (its own oracle), which takes the same keywords."""
    if "gated_delta" in op:
        from fla.ops.gated_delta_rule import naive

        return naive.naive_chunk_gated_delta_rule if op.startswith("chunk") else naive.naive_recurrent_gated_delta_rule
    from fla.ops.kda import naive

    return naive.naive_chunk_kda if op.startswith("chunk") else naive.naive_recurrent_kda


@needs_fla
@pytest.mark.parametrize("op", fla_ops.OPS)
def test_arguments_match_fla_semantics(op, close, real_fla):
    """Our inputs mapped by fla_arguments and given to fla's naive reference of the op give our reference's
    output and state: scale, gate, beta and state layout mean the same on both sides."""
    T = 64 if op.startswith("chunk") else 5  # fla's naive chunk form wants whole chunks
    args = _inputs(2, T, 3, 16, 8, per_head="gated_delta" in op, seed=len(op))
    ref = _fla_naive(op)
    kwargs = fla_ops.fla_arguments(op, *args)
    taken = inspect.signature(ref).parameters
    assert {"q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state"} <= set(taken)
    o, state = ref(**{name: value for name, value in kwargs.items() if name in taken})
    o_ref, s_ref = _ours(op, *args)
    close(o.float(), o_ref, 1e-5, f"{op} o")
    close(state.float(), s_ref, 1e-5, f"{op} state")


def test_arguments_checked():
    q, k, v, g, beta, state = _inputs(1, 3, 2, 16, 8, per_head=False)
    with pytest.raises(ValueError, match="not one of"):
        fla_ops.fla_arguments("chunk_rwkv7", q, k, v, g, beta, state)
    with pytest.raises(AssertionError, match="g"):
        fla_ops.fla_arguments("chunk_gated_delta_rule", q, k, v, g, beta, state)  # KDA's per-channel g
    kw = fla_ops.fla_arguments("chunk_kda", q, k, v, g, beta, state, lower_bound=-5.0)
    assert kw["safe_gate"] and kw["lower_bound"] == -5.0 and kw["scale"] == 1.0 and kw["output_final_state"]
    assert "safe_gate" not in fla_ops.fla_arguments("fused_recurrent_kda", q, k, v, g, beta, state, -5.0)


@pytest.mark.parametrize("T", [1, 40], ids=lambda t: f"T{t}")
def test_dispatchers_take_fla_on_gpu_tensors(T, monkeypatch, close):
    """With `usable` true (a CUDA tensor) and fla importable, both dispatchers call fla's op for the form
    (recurrent for a few tokens, chunk above) with fla_arguments' keywords and return fp32; without fla
    they take our Triton kernels (not run here)."""
    called = []

    def fake(op):
        def fn(**kw):
            called.append(op)
            gated = "gated_delta" in op
            o, s = _ours(op, kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], kw["initial_state"])
            return o.to(kw["v"].dtype if not gated else torch.bfloat16), s
        return fn

    for module in (kda_dispatch, gdn_dispatch):
        monkeypatch.setattr(module, "usable", lambda t: True)
    monkeypatch.setattr(fla_ops, "ops", lambda: {op: fake(op) for op in fla_ops.OPS})
    for per_head, dispatch in ((False, kda_dispatch.kda), (True, gdn_dispatch.gated_delta)):
        args = _inputs(1, T, 2, 16, 8, per_head=per_head, seed=T)
        o, s = dispatch(*args)
        assert o.dtype == s.dtype == torch.float32
        want = _ours("gated_delta" if per_head else "kda", *args)
        close(o, want[0], 1e-2, "o")
        close(s, want[1], 1e-6, "state")
    form = "fused_recurrent" if T <= kda_dispatch.RECURRENT_MAX_T else "chunk"
    assert called == [f"{form}_kda", f"{form}_gated_delta_rule"]
    monkeypatch.setattr(fla_ops, "ops", lambda: None)
    from localmoe.kernels.kda import triton as kda_triton

    ours = []
    monkeypatch.setattr(kda_triton, "_launch", lambda kernel, *a, **k: ours.append(kernel) or (None, None))
    kda_dispatch.kda(*_inputs(1, T, 2, 16, 8, per_head=False))
    assert ours and not called[2:]


@needs_fla
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
@pytest.mark.parametrize("op", [op for op in fla_ops.OPS if op.startswith("fused_recurrent")])
def test_fla_recurrent_kernels_under_interpreter(op, close, real_fla):
    """fla's own recurrent Triton kernels (not only its naive references) run on CPU tensors under the
    interpreter: through fla_arguments they give our reference's output and state (its chunk kernels
    need a GPU driver)."""
    args = _inputs(2, 3, 2, 16, 8, per_head="gated_delta" in op, seed=3)
    o, state = fla_ops.run(op, *args)
    want = _ours(op, *args)
    close(o, want[0], 1e-5, f"{op} o")
    close(state, want[1], 1e-5, f"{op} state")


needs_cuda_fla = pytest.mark.skipif(not (HAVE_FLA and torch.cuda.is_available()), reason="needs CUDA and fla-core")


@needs_cuda_fla
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("T", [1, 63, 500], ids=lambda t: f"T{t}")
@pytest.mark.parametrize("per_head", [False, True], ids=["kda", "gated_delta"])
def test_fla_on_cuda_matches_reference(per_head, T, dtype, close, real_fla):
    """The dispatchers on CUDA (fla's kernels) against our float32 references; bf16 inputs are compared
    with the reference on the same rounded inputs."""
    assert fla_ops.ops() is not None, "fla-core is installed but does not import"
    args = _inputs(2, T, 4, 64, 32, per_head=per_head, seed=T, bounded=not per_head)
    *inputs, state = args
    inputs = [t.to(dtype) for t in inputs]
    want = _ours("gated_delta" if per_head else "kda", *[t.float() for t in inputs], state)
    dispatch = gdn_dispatch.gated_delta if per_head else kda_dispatch.kda
    o, s = dispatch(*[t.cuda() for t in inputs], state.cuda())
    tol = 5e-3 if dtype == torch.float32 else 5e-2  # fla's fp32 tl.dot may run in tf32; bf16 inside
    close(o, want[0], tol, "o")
    close(s, want[1], tol, "state")
    if not per_head and T > kda_dispatch.RECURRENT_MAX_T:  # K3's bounded gate through fla's safe-gate path
        o, s = kda_dispatch.chunk_kda(*[t.cuda() for t in inputs], state.cuda(), lower_bound=-5.0)
        close(o, want[0], tol, "o, safe gate")
