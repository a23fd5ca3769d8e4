"""Gated DeltaNet layer against a float64 token-by-token re-derivation from Qwen's stored
layout (projections grouped per key head), across a prefill and cached decode steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from localmoe.engine.layers.gated_deltanet import Config, build, state_bytes
from localmoe.engine.step import Step
from localmoe.errors import LocalMoEError

D, HK, HV, K, V, W = 24, 2, 6, 8, 5, 4
G = HV // HK


def random_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, std=0.3: torch.randn(*s, generator=g) * std
    p = "layers.0.linear_attn."
    return {p + "in_proj_qkvz.weight": r(HK * (2 * K + 2 * G * V), D), p + "in_proj_ba.weight": r(2 * HV, D),
            p + "conv1d.weight": r(2 * HK * K + HV * V, 1, W), p + "A_log": r(HV).abs().log(),
            p + "dt_bias": r(HV), p + "norm.weight": 1 + r(V, std=0.1), p + "out_proj.weight": r(D, HV * V)}


def reference(weights: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """float64, one token at a time, reading Qwen's per-key-head grouping directly."""
    w = {k.split("linear_attn.")[1]: t.double() for k, t in weights.items()}
    B, T, _ = x.shape
    x = x.double()
    qkvz = (x @ w["in_proj_qkvz.weight"].T).view(B, T, HK, 2 * K + 2 * G * V)
    ba = (x @ w["in_proj_ba.weight"].T).view(B, T, HK, 2 * G)
    q, k, v, z = qkvz.split((K, K, G * V, G * V), dim=-1)
    b, a = ba[..., :G].reshape(B, T, HV), ba[..., G:].reshape(B, T, HV)
    mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)  # [B, T, C]
    padded = F.pad(mixed, (0, 0, W - 1, 0))
    conv = sum(padded[:, j:j + T] * w["conv1d.weight"][:, 0, j] for j in range(W))
    q, k, v = F.silu(conv).split((HK * K, HK * K, HV * V), dim=-1)
    q = F.normalize(q.view(B, T, HK, K), dim=-1, eps=0) * K ** -0.5
    k = F.normalize(k.view(B, T, HK, K), dim=-1, eps=0)
    v = v.view(B, T, HV, V)
    g = -w["A_log"].exp() * F.softplus(a + w["dt_bias"])
    beta = torch.sigmoid(b)
    S = torch.zeros(B, HV, K, V, dtype=torch.float64)
    out = torch.zeros(B, T, HV, V, dtype=torch.float64)
    for t in range(T):
        for h in range(HV):
            kh, qh = k[:, t, h // G], q[:, t, h // G]  # value head h reads key head h // G
            S[:, h] *= g[:, t, h].exp()[:, None, None]
            u = beta[:, t, h, None] * (v[:, t, h] - torch.einsum("bk,bkv->bv", kh, S[:, h]))
            S[:, h] += kh[:, :, None] * u[:, None, :]
            out[:, t, h] = torch.einsum("bk,bkv->bv", qh, S[:, h])
    o = out * torch.rsqrt(out.square().mean(-1, keepdim=True) + 1e-6) * w["norm.weight"] * F.silu(z.reshape(B, T, HV, V))
    return o.reshape(B, T, -1) @ w["out_proj.weight"].T


CONFIG = Config(HK, HV, K, V, W, hidden_size=D)


def step(start: int, T: int) -> Step:
    return Step(start, torch.arange(start, start + T)[None], None, None, None)


def test_prefill_and_decode_match_the_float64_rederivation():
    weights = random_weights()
    layer = build(CONFIG, weights, "layers.0.", dtype="float32")
    x = torch.randn(2, 11, D, generator=torch.Generator().manual_seed(1))
    expected = reference(weights, x)
    cache = layer.new_cache(2, 16)
    got = [layer(x[:, :7], step(0, 7), cache)] + [layer(x[:, t:t + 1], step(t, 1), cache) for t in range(7, 11)]
    torch.testing.assert_close(torch.cat(got, dim=1).double(), expected, rtol=1e-4, atol=1e-5)
    assert cache.offset == 11 and cache.state.shape == (2, HV, K, V)
    assert cache.nbytes() == state_bytes(layer.config, batch=2)


def test_value_heads_must_be_a_multiple_of_key_heads():
    with pytest.raises(LocalMoEError, match="multiple of linear_num_key_heads"):
        Config(num_key_heads=4, num_value_heads=6, key_head_dim=8, value_head_dim=8)


def test_a_cache_at_another_offset_is_refused():
    layer = build(CONFIG, random_weights(), "layers.0.", dtype="float32")
    with pytest.raises(LocalMoEError, match="starts at 3"):
        layer(torch.zeros(1, 1, D), step(3, 1), layer.new_cache(1, 8))


def test_native_chunk_matches_op_by_op(monkeypatch):
    """On the CPU everything between the projections runs as one C++ call (kernels/kda `gdn_chunk`: the fused decode
    step's arithmetic per token, value heads on their key head without a repeated copy): within 1e-5 of the op-by-op
    layer's output range, left padding included; a token's bits do not depend on the chunk it comes in."""
    from localmoe.engine.layers import gated_deltanet as gdn_layer
    from localmoe.testing.parity import assert_native_mixer_matches_op

    if not gdn_layer.mixer_available(torch.zeros(1), K, V):
        pytest.skip("the CPU kernel library is not built here")
    layer = build(CONFIG, random_weights(), "layers.0.", dtype="float32")
    x = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :6] = False
    x[1, :6] = 100.0
    assert_native_mixer_matches_op(gdn_layer, "gdn_chunk", layer, x, mask, monkeypatch)
