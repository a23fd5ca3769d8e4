"""Kimi Delta Attention: chunked = recurrent, prefill + decode = one prefill, left padding,
parity with transformers' KimiLinearDeltaAttention, K3's bounded / full-rank gates against
a float64 re-derivation, checkpoint names, and the state cache's trim rules."""

import math

import pytest
import torch
import torch.nn.functional as F

from localmoe.engine.cache import ModelCache
from localmoe.engine.layers.kda import (
    Config,
    KimiDeltaAttention,
    build,
    chunk_kda,
    l2norm,
    recurrent_kda,
    state_bytes,
)
from localmoe.engine.state_cache import DeltaStateCache, StateRollbackError
from localmoe.engine.step import make_step
from localmoe.testing import plan_checkpoint
from localmoe.testing.parity import assert_native_mixer_matches_op, run_mixer as run

D, H, K, W = 64, 4, 16, 4
VARIANTS = {
    "kimi_linear": Config(H, K, W, bounded_gate=False, full_rank_gate=False, norm_eps=1e-5, hidden_size=D),
    "kimi_k3": Config(H, K, W, bounded_gate=True, gate_lower_bound=-5.0, full_rank_gate=True, norm_eps=1e-5,
                      hidden_size=D),
}


def random_weights(config: Config, seed: int = 0, prefix: str = "layers.0.self_attn.") -> dict[str, torch.Tensor]:
    """KDA weights in Moonshot's on-disk layout (A_log padded to max(H, K) for K3)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, std=None):
        return torch.randn(*shape, generator=gen) * (std if std is not None else shape[-1] ** -0.5)

    d = H * K
    w = {f"{x}_proj.weight": rnd(d, D) for x in "qkv"}
    w |= {f"{x}_conv1d.weight": rnd(d, 1, W, std=0.5) for x in "qkv"}
    w |= {"f_a_proj.weight": rnd(K, D), "f_b_proj.weight": rnd(d, K), "b_proj.weight": rnd(H, D),
          "o_norm.weight": 1 + 0.1 * rnd(K, std=1), "o_proj.weight": rnd(D, d)}
    a_log = torch.empty(max(H, K) if config.bounded_gate else H).uniform_(1, 16, generator=gen).log()
    if config.bounded_gate:
        a_log[H:] = 50.0  # padding: would blow up the decay if it were read
    w["A_log"] = a_log if config.bounded_gate else a_log.view(1, 1, H, 1)
    dt = torch.empty(d).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp()
    w["dt_bias"] = dt + torch.log(-torch.expm1(-dt))  # inverse softplus, as fla initialises it
    if config.full_rank_gate:
        w["g_proj.weight"] = rnd(d, D)
    else:
        w |= {"g_a_proj.weight": rnd(K, D), "g_b_proj.weight": rnd(d, K)}
    return {prefix + k: v for k, v in w.items()}


def layer(variant: str, seed: int = 0) -> KimiDeltaAttention:
    config = VARIANTS[variant]
    return build(config, random_weights(config, seed), "layers.0.", dtype="float32")


def kernel_inputs(variant: str, B: int, T: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mixer = layer(variant, seed)
    q = l2norm(torch.randn(B, T, H, K, generator=gen)) * K ** -0.5
    k = l2norm(torch.randn(B, T, H, K, generator=gen))
    v = torch.randn(B, T, H, K, generator=gen)
    g = mixer.decay(torch.randn(B, T, H, K, generator=gen))
    beta = torch.rand(B, T, H, generator=gen)
    state = torch.randn(B, H, K, K, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T", [1, 63, 64, 65, 130], ids=lambda t: f"T{t}")
def test_chunk_equals_recurrence(variant, T):
    q, k, v, g, beta, state = kernel_inputs(variant, 2, T)
    check_chunk(q, k, v, g, beta, state)


@pytest.mark.parametrize("path", ["factorised", "pairwise"])
def test_chunk_sub_block_paths(path, monkeypatch):
    """Steep decays (here -30 per token, beyond fp32's exp range over a sub-block) take the
    pairwise path; the default data takes the factorised one; forcing either is exact."""
    from localmoe.kernels.kda import cpu as kda

    q, k, v, g, beta, state = kernel_inputs("kimi_linear", 2, 70)
    if path == "pairwise":
        monkeypatch.setattr(kda, "SAFE_EXP", 0.0)
        g = g - 30 * torch.rand(g.shape, generator=torch.Generator().manual_seed(9))
    else:
        g = g.clamp(min=-5.0)
    check_chunk(q, k, v, g, beta, state)


def check_chunk(q, k, v, g, beta, state):
    B, T = q.shape[:2]
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta, state)
    o, s = chunk_kda(q, k, v, g, beta, state)
    assert o.shape == (B, T, H, K) and s.shape == (B, H, K, K)
    assert (o - o_ref).abs().max() <= 1e-5
    assert (s - s_ref).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_prefill_then_decode_equals_one_prefill(variant):
    mixer = layer(variant)
    x = torch.randn(2, 96, D, generator=torch.Generator().manual_seed(1))
    full = run(mixer, x, [96])
    pieces = run(mixer, x, [70, 1, 1, 1, 20, 1, 1, 1])  # chunked, recurrent, chunked, recurrent
    assert (pieces - full).abs().max() <= 1e-5


def test_left_padding_equals_unpadded_row():
    mixer = layer("kimi_k3")
    x = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(2))
    pad = 5
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :pad] = False
    x[1, :pad] = 100.0  # garbage in padding slots must not leak into the state or the conv tail
    out = run(mixer, x, [30, 1, 9], mask)
    alone = run(mixer, x[1:, pad:], [25, 1, 9])
    assert (out[1, pad:] - alone[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_native_chunk_matches_op_by_op(variant, monkeypatch):
    """On the CPU everything between the projections runs as one C++ call (kernels/kda `kda_chunk`, the fused decode
    step's arithmetic per token): within 1e-5 of the op-by-op layer's output range, left padding included; a token's
    bits do not depend on the chunk it comes in (one call of 40, or 13 + 1 + 26, or one token at a time)."""
    from localmoe.engine.layers import kda as kda_layer

    if not kda_layer.mixer_available(torch.zeros(1), K):
        pytest.skip("the CPU kernel library is not built here")
    mixer = layer(variant)
    x = torch.randn(2, 40, D, generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 40, dtype=torch.bool)
    mask[1, :6] = False
    x[1, :6] = 100.0
    assert_native_mixer_matches_op(kda_layer, "kda_chunk", mixer, x, mask, monkeypatch)


def test_native_chunk_state_in_place_unless_recording():
    """A cache that is not recording has its state and conv tail advanced where they are (no copies); a recording
    cache gets new tensors each call, so the snapshots it keeps stay as they were (trim returns to one)."""
    from localmoe.engine.layers import kda as kda_layer

    if not kda_layer.mixer_available(torch.zeros(1), K):
        pytest.skip("the CPU kernel library is not built here")
    mixer = layer("kimi_linear")
    x = torch.randn(1, 30, D, generator=torch.Generator().manual_seed(4))
    cache = ModelCache([mixer.new_cache(1, 30)], 1, 30, mixer.device)
    states = cache.layers[0]

    def feed(n: int) -> None:
        start = cache.reserve(n)
        cache.append_mask(None, n)
        mixer(x[:, start:start + n], make_step(cache, start, n, None), states)
        cache.advance(n)

    held = states.state, states.conv_tail
    feed(10)
    assert states.state is held[0] and states.conv_tail is held[1]
    states.record(True)
    feed(10)
    kept = states.state.clone(), states.conv_tail.clone()
    feed(10)
    states.trim(20)
    assert torch.equal(states.state, kept[0]) and torch.equal(states.conv_tail, kept[1])


def hf_layer_and_ours(seed: int = 0):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import (
        KimiLinearDeltaAttention,
    )

    torch.manual_seed(seed)
    config_dict = {"num_heads": H, "head_dim": K, "short_conv_kernel_size": W, "kda_layers": [1],
                   "full_attn_layers": [2]}
    config = KimiLinearConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
                              linear_attn_config=config_dict, rms_norm_eps=1e-5)
    hf = KimiLinearDeltaAttention(config, 0).float().eval()
    ours = random_weights(VARIANTS["kimi_linear"], seed, prefix="")
    sd = {"conv1d.weight": torch.cat([ours[f"{x}_conv1d.weight"] for x in "qkv"])}
    for name, t in ours.items():
        if name.startswith(("f_a_proj", "f_b_proj", "A_log", "dt_bias")):
            sd["forget_gate." + name] = t
        elif "conv1d" not in name:
            sd[name] = t
    hf.load_state_dict(sd, strict=True)
    config = Config.from_hf({"linear_attn_config": config_dict, "rms_norm_eps": 1e-5, "hidden_size": D}, "kimi_linear")
    mine = build(config, {"layers.0.self_attn." + k: v for k, v in ours.items()}, "layers.0.", dtype="float32")
    return hf, mine


def test_matches_transformers_kimi_linear():
    hf, mine = hf_layer_and_ours()
    assert not mine.config.bounded_gate and not mine.config.full_rank_gate and mine.config.norm_eps == 1e-5
    x = torch.randn(2, 70, D, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = hf(x)
    got = run(mine, x, [70])
    # atol 5e-6: transformers' own fp32 chunk form lies up to 2.7e-6 from the float64 layer (float64_kda) on this
    # input (outputs up to 2.3); ours, the delta rule token by token in C++, 6.5e-7
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=5e-6)
    got_steps = run(mine, x, [65, 1, 1, 1, 1, 1])
    torch.testing.assert_close(got_steps, expected, rtol=1e-4, atol=5e-6)


def float64_kda(w: dict[str, torch.Tensor], config: Config, x: torch.Tensor) -> torch.Tensor:
    """The layer re-derived from the formulas, token by token, in float64 (own code, no engine imports)."""
    w = {k.removeprefix("layers.0.self_attn."): v.double() for k, v in w.items()}
    x = x.double()
    B, T, _ = x.shape

    def lin(name, t):
        return t @ w[name + ".weight"].T

    conv = [F.conv1d(lin(f"{n}_proj", x).transpose(1, 2), w[f"{n}_conv1d.weight"], padding=W - 1,
                     groups=H * K)[..., :T].transpose(1, 2) for n in "qkv"]
    q, k, v = (F.silu(c).view(B, T, H, K) for c in conv)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(K)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    f = (lin("f_b_proj", lin("f_a_proj", x)) + w["dt_bias"]).view(B, T, H, K)
    A = w["A_log"].flatten()[:H].exp().view(1, 1, H, 1)
    if config.bounded_gate:
        g = config.gate_lower_bound * torch.sigmoid(A * f)
    else:
        g = -A * torch.log1p(torch.exp(f))
    beta = torch.sigmoid(lin("b_proj", x))
    S = torch.zeros(B, H, K, K, dtype=torch.float64)
    out = torch.empty(B, T, H, K, dtype=torch.float64)
    for t in range(T):
        S = torch.exp(g[:, t])[..., None] * S
        pred = (S * k[:, t, :, :, None]).sum(-2)  # S^T k
        S = S + k[:, t, :, :, None] * (beta[:, t, :, None] * (v[:, t] - pred))[:, :, None, :]
        out[:, t] = (S * q[:, t, :, :, None]).sum(-2)
    gate = lin("g_proj", x) if config.full_rank_gate else lin("g_b_proj", lin("g_a_proj", x))
    normed = out / torch.sqrt((out * out).mean(-1, keepdim=True) + config.norm_eps) * w["o_norm.weight"]
    return lin("o_proj", (normed * torch.sigmoid(gate.view(B, T, H, K))).reshape(B, T, H * K))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gates_match_float64_derivation(variant):
    config = VARIANTS[variant]
    weights = random_weights(config, seed=4)
    mixer = build(config, weights, "layers.0.", dtype="float32")
    x = torch.randn(2, 70, D, generator=torch.Generator().manual_seed(5))
    expected = float64_kda(weights, config, x).float()
    torch.testing.assert_close(run(mixer, x, [70]), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run(mixer, x, [66, 1, 1, 1, 1]), expected, rtol=1e-4, atol=1e-5)


def test_bounded_gate_stays_within_lower_bound():
    mixer = layer("kimi_k3")
    g = mixer.decay(torch.randn(1, 8, H, K) * 100)
    assert g.min() >= -5.0 and g.max() <= 0.0


@pytest.mark.parametrize("variant", ["kimi_linear", "kimi_k3"])
def test_layer_passes_its_gate_bound_to_the_kernels(variant, monkeypatch):
    """A bounded gate's lower bound reaches the kda dispatcher (on CUDA, fla's chunk_kda takes its safe-gate
    path with it: tests/kernels/test_fla_ops.py); an unbounded gate passes none."""
    from localmoe.engine.layers import kda as kda_layer

    seen, kernel = [], kda_layer.kda

    def spy(q, k, v, g, beta, state, lower_bound=None):
        seen.append(lower_bound)
        return kernel(q, k, v, g, beta, state, lower_bound)

    monkeypatch.setattr(kda_layer, "kda", spy)
    monkeypatch.setattr(kda_layer, "mixer_available", lambda *dims: False)  # the op-by-op form (the CPU's C++ below)
    run(layer(variant), torch.randn(1, 13, D), [12, 1])  # a chunked prefill, then a decode step
    assert seen == [-5.0, -5.0] if variant == "kimi_k3" else seen == [None, None]


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3"])
def test_checkpoint_layout_and_config(family):
    """The tiny real-layout checkpoints' names/shapes load, and the variant comes from the family."""
    plan = plan_checkpoint(family, "tiny")
    text = plan.config.get("text_config", plan.config)
    config = Config.from_hf(text, family)
    assert config.bounded_gate == config.full_rank_gate == (family == "kimi_k3")
    assert (config.num_heads, config.head_dim, config.conv_kernel, config.gate_lower_bound) == (H, K, W, -5.0)
    prefix = "language_model.model." if family == "kimi_k3" else "model."
    gen = torch.Generator().manual_seed(0)
    weights = {t.name.removeprefix(prefix): torch.rand(t.shape, generator=gen) * 0.1 for t in plan.tensors
               if t.name.startswith(prefix + "layers.0.self_attn.")}
    mixer = build(config, weights, "layers.0.", dtype="float32")
    cache = mixer.new_cache(1, 8)
    assert cache.nbytes() == state_bytes(config) == 4 * (H * K * K + (W - 1) * 3 * H * K)
    assert torch.isfinite(run(mixer, torch.randn(1, 8, D), [6, 1, 1])).all()


def test_from_hf_rejects_unknown_family():
    from localmoe.errors import LocalMoEError

    with pytest.raises(LocalMoEError, match="no variant"):
        Config.from_hf({"linear_attn_config": {"num_heads": 1, "head_dim": 8}}, "qwen3_next")


def test_state_cache_trim_rules():
    mixer = layer("kimi_k3")
    x = torch.randn(1, 30, D, generator=torch.Generator().manual_seed(6))
    cache = ModelCache([mixer.new_cache(1, 30)], 1, 30)
    layer_cache: DeltaStateCache = cache.layers[0]

    def feed(lo, hi):
        start = cache.reserve(hi - lo)
        out = mixer(x[:, lo:hi], make_step(cache, start, hi - lo, None), layer_cache)
        cache.advance(hi - lo)
        return out

    feed(0, 12)
    assert layer_cache.snapshot() == 12
    first = feed(12, 20)
    cache.trim(20)  # nothing to forget
    assert layer_cache.offset == 20
    with pytest.raises(StateRollbackError, match="snapshot"):
        cache.trim(15)
    cache.trim(12)  # restores the snapshot
    assert layer_cache.offset == cache.offset == 12
    assert torch.equal(feed(12, 20), first)
    cache.trim(0)
    assert layer_cache.offset == 0 and not layer_cache.state.any() and not layer_cache.conv_tail.any()
    assert (feed(0, 12) - run(mixer, x[:, :12], [12])).abs().max() == 0


def test_step_valid_is_used_when_present():
    """A chunk made only of left padding (e.g. a chunked batched prefill) is skipped via `step.valid`."""
    from types import SimpleNamespace

    mixer = layer("kimi_linear")
    x = torch.randn(1, 12, D, generator=torch.Generator().manual_seed(7))
    cache = mixer.new_cache(1, 12)
    pad = SimpleNamespace(start=0, mask=None, valid=torch.zeros(1, 4, dtype=torch.bool))
    mixer(torch.full((1, 4, D), 100.0), pad, cache)
    assert not cache.state.any() and not cache.conv_tail.any() and cache.offset == 4
    cache.offset = 0  # the padding slots hold no tokens; compare the real ones with a fresh run
    real = mixer(x, SimpleNamespace(start=0, mask=None, valid=None), cache)
    assert (real - run(mixer, x, [12])).abs().max() == 0


def test_real_checkpoint_layers_match_transformers(tmp_path):
    """From a written tiny Kimi-Linear checkpoint: our layers built from the on-disk tensors
    equal transformers' layers loaded (and renamed/concatenated) by from_pretrained."""
    import json

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from localmoe.engine.layers import mla as mla_layer
    from localmoe.testing import write_checkpoint

    write_checkpoint("kimi_linear", tmp_path, "tiny")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    config = json.loads((tmp_path / "config.json").read_text())
    weights = {}
    for shard in sorted(tmp_path.glob("*.safetensors")):
        weights |= {k.removeprefix("model."): v for k, v in load_file(shard).items()}
    x = torch.randn(2, 70, D, generator=torch.Generator().manual_seed(8))
    kda = build(Config.from_hf(config, "kimi_linear"), weights, "layers.0.", dtype="float32")
    mla = mla_layer.build(mla_layer.Config.from_hf(config), weights, "layers.3.", dtype="float32")
    causal = torch.full((70, 70), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected_kda = hf.model.layers[0].self_attn(x)
        expected_mla, _ = hf.model.layers[3].self_attn(x, attention_mask=causal)
    torch.testing.assert_close(run(kda, x, [67, 1, 1, 1]), expected_kda, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(run(mla, x, [67, 1, 1, 1]), expected_mla, rtol=1e-4, atol=1e-6)
