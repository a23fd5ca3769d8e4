"""KDA Triton kernels (recurrent decode, chunked prefill) against the token-by-token reference,
and the engine's chunked form against the same reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from localmoe.kernels.kda.reference import naive_recurrent_kda

from .conftest import TRITON_DEVICES


def _inputs(B, T, H, K, V, seed, dtype=torch.float32, steep=False, per_head=False):
    g_ = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1) * K ** -0.5
    k = F.normalize(torch.randn(B, T, H, K, generator=g_), dim=-1)
    v = torch.randn(B, T, H, V, generator=g_)
    shape = (B, T, H, 1) if per_head else (B, T, H, K)
    g = -torch.rand(*shape, generator=g_) * (8.0 if steep else 0.3)  # steep: decays down to e^-8 per step
    beta = torch.rand(B, T, H, generator=g_)
    state = torch.randn(B, H, K, V, generator=g_) * 0.1
    return [t.to(dtype) for t in (q, k, v, g, beta)] + [state]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("B,T,H,K,V", [(1, 1, 2, 32, 32), (2, 3, 1, 24, 40), (1, 8, 3, 64, 16)],
                         ids=lambda *a: None)
def test_fused_recurrent(B, T, H, K, V, dtype, device, close):
    from localmoe.kernels.kda.triton import fused_recurrent_kda

    args = _inputs(B, T, H, K, V, seed=T * 7 + K, dtype=dtype)
    o_ref, s_ref = naive_recurrent_kda(*[a.float() for a in args])
    o, s = fused_recurrent_kda(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


CHUNK_CASES = [pytest.param(1, 1, 1, 32, 32, False, id="T1"), pytest.param(1, 63, 2, 32, 24, False, id="T63"),
               pytest.param(2, 70, 1, 16, 16, True, id="T70-steep-B2"),
               pytest.param(1, 500, 1, 32, 32, False, id="T500", marks=pytest.mark.slow)]


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("B,T,H,K,V,steep", CHUNK_CASES)
def test_chunk(B, T, H, K, V, steep, device, close):
    from localmoe.kernels.kda.triton import chunk_kda

    args = _inputs(B, T, H, K, V, seed=T + K, steep=steep)
    o_ref, s_ref = naive_recurrent_kda(*args)
    o, s = chunk_kda(*[a.to(device) for a in args])
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T{t}")
def test_engine_chunked_matches_reference(T, close):
    """The CPU prefill path (kernels/kda/cpu.py, as the engine reaches it) against the same spec."""
    from localmoe.engine.layers.kda import chunk_kda as engine_chunk

    args = _inputs(1, T, 2, 32, 32, seed=T)
    o_ref, s_ref = naive_recurrent_kda(*args)
    o, s = engine_chunk(*args)
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")


needs_library = pytest.mark.skipif(__import__("localmoe.kernels._cpu", fromlist=["library"]).library() is None,
                                   reason="CPU kernel library unavailable (no AVX2 or compiler)")
NATIVE_CASES = [pytest.param(1, 1, 2, 32, 32, False, id="T1"), pytest.param(2, 63, 3, 24, 40, True, id="T63-steep-B2"),
                pytest.param(1, 130, 2, 64, 64, False, id="T130"), pytest.param(1, 70, 1, 128, 128, True, id="T70-K128")]


def _native_args(B, T, H, K, V, steep, per_head, seed):
    q, k, v, g, beta, state = _inputs(B, T, H, K, V, seed=seed, steep=steep, per_head=per_head)
    return q, k, v, (g[..., 0] if per_head else g), beta, state


@needs_library
@pytest.mark.parametrize("per_head", [False, True], ids=["kda", "gated_delta"])
@pytest.mark.parametrize("B,T,H,K,V,steep", NATIVE_CASES)
def test_native_token_loop_matches_reference(B, T, H, K, V, steep, per_head, close):
    """The C++ token loop (kernels/kda/native.py) for KDA's per-channel and Gated DeltaNet's per-head decay."""
    from localmoe.kernels.kda import native

    q, k, v, g, beta, state = _native_args(B, T, H, K, V, steep, per_head, seed=T * 3 + K)
    before = state.clone()
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g.unsqueeze(-1) if per_head else g, beta, state)
    o, s = native.delta_rule(q, k, v, g, beta, state, scalar_decay=per_head)
    close(o, o_ref, 1e-5, "o")
    close(s, s_ref, 1e-5, "state")
    assert torch.equal(state, before), "the input state is left as it was"


@needs_library
@pytest.mark.parametrize("per_head", [False, True], ids=["kda", "gated_delta"])
def test_native_tokens_get_their_one_token_bits(per_head):
    """A chunk's T tokens in one call give each token (and the final state) the bits of T calls of one token:
    the fused decode step's update, so prefill and decode run the same delta rule."""
    from localmoe.kernels.kda import native

    q, k, v, g, beta, state = _native_args(2, 19, 3, 40, 24, True, per_head, seed=5)
    o, s = native.delta_rule(q, k, v, g, beta, state, scalar_decay=per_head)
    S, outs = state, []
    for t in range(q.shape[1]):
        one, S = native.delta_rule(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), S, scalar_decay=per_head)
        outs.append(one)
    assert torch.equal(o, torch.cat(outs, dim=1)) and torch.equal(s, S)


@needs_library
@pytest.mark.parametrize("T", [1, 9, 72], ids=lambda t: f"T{t}")
def test_cpu_dispatcher_runs_the_token_loop(T):
    from localmoe.kernels.kda import kda, native

    args = _inputs(1, T, 2, 32, 16, seed=T)
    o, s = kda(*args)
    o_native, s_native = native.delta_rule(*args, scalar_decay=False)
    assert torch.equal(o, o_native) and torch.equal(s, s_native)
