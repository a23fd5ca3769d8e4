"""MLA: absorbed decode = expanded attention, prefill + decode = one prefill, left padding,
parity with transformers' KimiLinearAttention (NoPE), K3's gated output against a float64
re-derivation, checkpoint names, and the latent cache's bytes per token."""

import pytest
import torch

from localmoe.engine.layers import mla as mla_layer
from localmoe.engine.layers.mla import Config, MLAttention, build
from localmoe.kernels import _cpu
from localmoe.testing import plan_checkpoint
from localmoe.testing.parity import assert_native_mixer_matches_op, run_mixer as run

D, H, R, NOPE, ROPE, V = 64, 4, 32, 16, 8, 16
CONFIGS = {
    "kimi_linear": Config(H, None, R, NOPE, ROPE, V, output_gate=False, use_nope=True, hidden_size=D),
    "kimi_k3": Config(H, 24, R, NOPE, ROPE, V, output_gate=True, use_nope=True, hidden_size=D),
}


def random_weights(c: Config, seed: int = 0, prefix: str = "layers.0.self_attn.") -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    qk = NOPE + ROPE
    if c.q_lora_rank is None:
        w = {"q_proj.weight": rnd(H * qk, D)}
    else:
        w = {"q_a_proj.weight": rnd(c.q_lora_rank, D), "q_a_layernorm.weight": 1 + 0.1 * rnd(c.q_lora_rank) * 5,
             "q_b_proj.weight": rnd(H * qk, c.q_lora_rank)}
    w |= {"kv_a_proj_with_mqa.weight": rnd(R + ROPE, D), "kv_a_layernorm.weight": 1 + 0.5 * rnd(R),
          "kv_b_proj.weight": rnd(H * (NOPE + V), R) * 2, "o_proj.weight": rnd(D, H * V)}
    if c.output_gate:
        w["g_proj.weight"] = rnd(H * V, D)
    return {prefix + k: v for k, v in w.items()}


def layer(name: str, seed: int = 0, absorb: bool | None = None) -> MLAttention:
    mixer = build(CONFIGS[name], random_weights(CONFIGS[name], seed), "layers.0.", dtype="float32")
    mixer.absorb = absorb
    return mixer


def inputs(T: int, seed: int = 1, B: int = 2) -> torch.Tensor:
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_absorbed_equals_expanded(name):
    x = inputs(40)
    chunks = [23, 1, 1, 14, 1]
    expanded = run(layer(name, absorb=False), x, chunks)
    absorbed = run(layer(name, absorb=True), x, chunks)
    assert (absorbed - expanded).abs().max() <= 1e-5


@pytest.mark.skipif(_cpu.library() is None, reason="needs the CPU kernel library")
@pytest.mark.parametrize("name", list(CONFIGS))
def test_chunk_kernel_matches_op_by_op(name, monkeypatch):
    """The CPU prefill's one C++ call (kernels/mla_decode `mla_chunk`) for Kimi-Linear and K3 (q LoRA, output gate):
    30 tokens in one call == 13 + 1 + 16 == 30 calls of one bit for bit, within 1e-5 of the op-by-op layer."""
    mixer = layer(name)
    assert mixer.use_absorbed(30, 30) and not mixer.use_absorbed(40, 40)  # the kernel where absorption is cheaper
    assert_native_mixer_matches_op(mla_layer, "mla_chunk", mixer, inputs(30), None, monkeypatch, "chunk_available")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_then_decode_equals_one_prefill(name):
    mixer = layer(name)
    assert mixer.use_absorbed(1) and not mixer.use_absorbed(40)  # decode absorbed, long prefill expanded
    x = inputs(48)
    full = run(mixer, x, [48])
    assert (run(mixer, x, [40, 1, 1, 1, 5]) - full).abs().max() <= 1e-5


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_left_padding_equals_unpadded_row(absorb):
    mixer = layer("kimi_k3", absorb=absorb)
    x = inputs(20)
    pad = 4
    mask = torch.ones(2, 20, dtype=torch.bool)
    mask[1, :pad] = False
    x[1, :pad] = 100.0
    out = run(mixer, x, [15, 1, 4], mask)
    alone = run(mixer, x[1:, pad:], [11, 1, 4])
    assert (out[1, pad:] - alone[0]).abs().max() <= 1e-5


@pytest.mark.parametrize("q_lora_rank", [None, 24], ids=["q_proj", "q_lora"])
def test_matches_transformers_kimi_linear(q_lora_rank):
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearAttention

    config = KimiLinearConfig(hidden_size=D, num_hidden_layers=2, num_attention_heads=H, num_key_value_heads=H,
                              vocab_size=128, q_lora_rank=q_lora_rank, kv_lora_rank=R, qk_nope_head_dim=NOPE,
                              qk_rope_head_dim=ROPE, v_head_dim=V)
    config._attn_implementation = "eager"
    hf = KimiLinearAttention(config, 1).float().eval()
    ours = Config.from_hf(config.to_dict() | {"mla_use_nope": True})
    assert ours == Config(H, q_lora_rank, R, NOPE, ROPE, V, output_gate=False, use_nope=True, hidden_size=D)
    weights = random_weights(ours, seed=2, prefix="")
    hf.load_state_dict(weights, strict=True)
    T = 24
    x = inputs(T, seed=3)
    causal = torch.full((T, T), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        expected, _ = hf(x, attention_mask=causal)
    for absorb in (False, True):
        mixer = build(ours, {"layers.0.self_attn." + k: v for k, v in weights.items()}, "layers.0.", dtype="float32")
        mixer.absorb = absorb
        torch.testing.assert_close(run(mixer, x, [T]), expected, rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(run(mixer, x, [20, 1, 1, 1, 1]), expected, rtol=1e-4, atol=1e-6)


def float64_mla(w: dict[str, torch.Tensor], c: Config, x: torch.Tensor) -> torch.Tensor:
    """Gated MLA re-derived per head in float64, expanded, causal (own code, no engine imports)."""
    w = {k.removeprefix("layers.0.self_attn."): v.double() for k, v in w.items()}
    x = x.double()
    B, T, _ = x.shape

    def rms(t, weight, eps=1e-6):
        return t / torch.sqrt((t * t).mean(-1, keepdim=True) + eps) * weight

    q = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"]) @ w["q_b_proj.weight"].T
    q = q.view(B, T, H, NOPE + ROPE)
    kv = x @ w["kv_a_proj_with_mqa.weight"].T
    latent, k_rope = rms(kv[..., :R], w["kv_a_layernorm.weight"]), kv[..., R:]
    kvb = (latent @ w["kv_b_proj.weight"].T).view(B, T, H, NOPE + V)
    out = torch.zeros(B, T, H, V, dtype=torch.float64)
    for h in range(H):
        keys = torch.cat([kvb[:, :, h, :NOPE], k_rope], dim=-1)  # [B, T, NOPE + ROPE], no rotary
        scores = q[:, :, h] @ keys.transpose(1, 2) / (NOPE + ROPE) ** 0.5
        scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        out[:, :, h] = scores.softmax(-1) @ kvb[:, :, h, NOPE:]
    gated = out.reshape(B, T, H * V) * torch.sigmoid(x @ w["g_proj.weight"].T)
    return gated @ w["o_proj.weight"].T


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_k3_gated_output_matches_float64_derivation(absorb):
    c = CONFIGS["kimi_k3"]
    weights = random_weights(c, seed=4)
    mixer = build(c, weights, "layers.0.", dtype="float32")
    mixer.absorb = absorb
    x = inputs(30, seed=5)
    expected = float64_mla(weights, c, x).float()
    torch.testing.assert_close(run(mixer, x, [30]), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(run(mixer, x, [26, 1, 1, 1, 1]), expected, rtol=1e-4, atol=1e-5)


def test_cache_holds_only_latent_and_rope_part():
    mixer = layer("kimi_k3")
    B, S = 2, 50
    cache = mixer.new_cache(B, S)
    assert cache.bytes_per_token() == (R + ROPE) * 4
    assert cache.nbytes() == B * S * (R + ROPE) * torch.float32.itemsize


@pytest.mark.parametrize("family", ["kimi_linear", "kimi_k3"])
def test_checkpoint_layout_and_config(family):
    plan = plan_checkpoint(family, "tiny")
    text = plan.config.get("text_config", plan.config)
    c = Config.from_hf(text)
    assert c.use_nope and c.output_gate == (family == "kimi_k3") and (c.q_lora_rank is None) == (family != "kimi_k3")
    prefix = "language_model.model." if family == "kimi_k3" else "model."
    gen = torch.Generator().manual_seed(0)
    weights = {t.name.removeprefix(prefix): torch.rand(t.shape, generator=gen) * 0.1 for t in plan.tensors
               if t.name.startswith(prefix + "layers.3.self_attn.")}
    mixer = build(c, weights, "layers.3.", dtype="float32")
    assert torch.isfinite(run(mixer, inputs(8, B=1), [6, 1, 1])).all()


def test_absorbed_sdpa_branch_equals_matmul_branch(monkeypatch):
    from localmoe.engine.layers import mla

    x = inputs(20)
    mixer = layer("kimi_k3", absorb=True)
    small = run(mixer, x, [15, 1, 4])
    monkeypatch.setattr(mla, "SCORES_MAX_BYTES", 0)
    assert (run(mixer, x, [15, 1, 4]) - small).abs().max() <= 1e-5


@pytest.mark.parametrize("absorb", [False, True], ids=["expanded", "absorbed"])
def test_mla_blockwise_prefill_equals_one_block(monkeypatch, absorb):
    """Both MLA forms over many 64-key blocks (causal, then left-padded) = the same call in one block."""
    from localmoe.engine.layers import mla

    x = inputs(300)
    mask = torch.ones(2, 300, dtype=torch.bool)
    mask[1, :70] = False
    mixer = layer("kimi_k3", absorb=absorb)
    whole = run(mixer, x, [200, 1, 99]), run(mixer, x, [200, 1, 99], mask)
    monkeypatch.setattr(mla, "SCORES_MAX_BYTES", 0)
    blocks = run(mixer, x, [200, 1, 99]), run(mixer, x, [200, 1, 99], mask)
    for a, b in zip(whole, blocks):
        assert (a - b).abs().max() <= 1e-5


def test_expanded_prefill_through_flash_blocks_equals_absorbed(monkeypatch):
    """An unpadded expanded prefill runs torch's flash kernel per key block (64-key blocks here: the keys
    before the chunk, then the chunk's own keys as causal squares plus the later queries) and equals the
    absorbed form's explicit softmax."""
    from localmoe.engine.layers import mla

    calls = []
    flash = mla.flash_attention
    monkeypatch.setattr(mla, "flash_attention", lambda *a, **k: calls.append(k.get("causal", False)) or flash(*a, **k))
    monkeypatch.setattr(mla, "KV_BLOCK_BYTES", 0)
    x = inputs(300)
    expanded = run(layer("kimi_k3", absorb=False), x, [130, 1, 169])
    # causal squares: 130 own keys in 3 blocks, the decode token's 1, 169 in 3; whole blocks: the later queries
    # of the chunks' first two blocks (2 + 2) and the cached keys before the decode token and the last chunk (3 + 3)
    assert (calls.count(True), calls.count(False)) == (3 + 1 + 3, 2 + 3 + 3 + 2)
    assert (expanded - run(layer("kimi_k3", absorb=True), x, [130, 1, 169])).abs().max() <= 1e-5
