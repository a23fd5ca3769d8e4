"""Paged K/V and latent caches (engine/cache.py): FP8 round trip, block tables, allocation,
trim; cache sizing of ModelSpec.kv_bytes_per_token against what the caches allocate, and
the 1M-token Kimi K3 figure from the real-dimension config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import localmoe.testing
from localmoe.config import KV_CACHE_DTYPES
from localmoe.engine import cache as cache_module
from localmoe.engine.cache import KVCache, ModelCache, PagedBuffer, dequantize_fp8, quantize_fp8
from localmoe.engine.layers.kda import state_bytes
from localmoe.engine.state_cache import DeltaStateCache, LatentCache, StateRollbackError
from localmoe.models import family_for_model_type

K3_REAL = Path(localmoe.testing.__file__).parent / "configs" / "kimi_k3_real.json"
MILLION = 1 << 20


def rows(B: int, T: int, *shape: int, seed: int = 0) -> torch.Tensor:
    """Random rows [B, T, *shape] whose blocks (last dim) differ in magnitude by up to 10^4."""
    x = torch.randn(B, T, *shape, generator=torch.Generator().manual_seed(seed))
    blocks = x[..., 0].numel()
    return x * torch.logspace(-2, 2, blocks).view(*x.shape[:-1], 1)


@pytest.mark.parametrize("shape", [(4, 7), (3, 128), (577,)], ids=["heads4x7", "heads3x128", "row577"])
def test_fp8_round_trip_error_is_bounded_per_block(shape):
    x = rows(2, 33, *shape, seed=1)
    x[0, 5] = 0  # an all-zero block must come back as zeros
    q, scale = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == x.shape[:-1] and scale.dtype == torch.float32
    back = dequantize_fp8(q, scale)
    # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative in the normal range; subnormal spacing
    # 2^-9 (in units of scale) -> 2^-10 * scale absolute below it. Slack for the fp32 divide.
    bound = 2.0 ** -4 * x.abs() + 2.0 ** -10 * scale.unsqueeze(-1)
    assert ((back - x).abs() <= bound * (1 + 1e-6) + 1e-30).all()
    assert torch.equal(back[0, 5], torch.zeros_like(x[0, 5]))
    # each block's largest magnitude maps to 448 and comes back exactly
    amax = x.abs().amax(-1, keepdim=True)
    hit = x.abs() == amax
    assert torch.allclose(back.abs()[hit & (amax > 0)], x.abs()[hit & (amax > 0)], rtol=1e-6, atol=0)
    # the bound is not vacuous: fp8 really is lossy here
    assert (back - x).abs().max() > 0


@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
@pytest.mark.parametrize("batch", [1, 2])
def test_paged_buffer_reads_back_what_was_written_across_blocks(small_blocks, dtype, batch):
    buf = PagedBuffer(batch, 100, 3, 8, dtype)
    x = rows(batch, 3, 70, 8, seed=2)  # [B, H, T, D]
    for lo, hi in ((0, 5), (5, 6), (6, 40), (40, 41), (41, 70)):  # prefill pieces and single steps
        buf.write(lo, x[:, :, lo:hi])
        got = buf.read(hi)
        assert got.shape == (batch, 3, hi, 8) and got.dtype == torch.float32
        assert torch.equal(got[:, :, :lo], buf.read(lo)) if lo else True  # earlier positions are left alone
    want = x if dtype == "float32" else with_exact_tail(x, ROUND_TRIP[dtype](x), 70)
    assert torch.equal(buf.read(70), want)
    assert len(buf.table[0]) == 5 and all(len(t) == 5 for t in buf.table)  # ceil(70 / 16) blocks per sequence
    # batch 2 interleaves the two sequences' blocks in the pool: a gather, not a view
    assert (buf._flat is not None) == (batch == 1)


ROUND_TRIP = {"bfloat16": lambda x: x.bfloat16().float(), "fp8": lambda x: dequantize_fp8(*quantize_fp8(x))}


def with_exact_tail(x: torch.Tensor, rounded: torch.Tensor, exact_from: int) -> torch.Tensor:
    """What a bf16/fp8 buffer holding x [B, H, T, D] reads: `rounded` (x's round trip), except positions
    from `exact_from` that are among the last EXACT_RECENT written, which are exact (at the end of x,
    `exact_from` = T means "the ring's whole span")."""
    want = rounded.clone()
    lo = max(exact_from - cache_module.EXACT_RECENT, 0) if exact_from == x.shape[2] else exact_from
    want[:, :, lo:] = x[:, :, lo:]
    return want


def test_fp8_keeps_the_newest_positions_exact_until_they_are_trimmed(small_blocks):
    ring = cache_module.EXACT_RECENT
    buf = PagedBuffer(1, 200, 2, 8, "fp8")
    x = rows(1, 2, 100, 8, seed=4)
    buf.write(0, x)
    got = buf.read(100)
    assert torch.equal(got[:, :, 100 - ring:], x[:, :, 100 - ring:])  # the ring: exact
    assert torch.equal(got[:, :, :100 - ring], dequantize_fp8(*quantize_fp8(x[:, :, :100 - ring])))
    assert not torch.equal(got[:, :, :100 - ring], x[:, :, :100 - ring])  # older positions really are fp8
    buf.trim(90)  # the ring still holds 68..89 exactly; 90..99 are gone
    got = buf.read(90)
    assert torch.equal(got[:, :, 68:], x[:, :, 68:90])
    assert torch.equal(got[:, :, :68], dequantize_fp8(*quantize_fp8(x[:, :, :68])))
    y = rows(1, 2, 1, 8, seed=5)
    buf.write(90, y)  # one decode step: its slot (90 % ring) held position 58, which stays fp8
    assert torch.equal(buf.read(91)[:, :, 90:], y)
    assert torch.equal(buf.read(91)[:, :, 68:90], x[:, :, 68:90])


def test_allocation_grows_with_the_context_not_max_len(small_blocks):
    cache = KVCache(1, 2, 1_000_000, 4)
    per_block = 2 * 16 * 2 * 4 * 4  # K and V, 16 tokens, 2 heads x 4 values, fp32
    assert cache.nbytes() == per_block  # one block up front, however long the context may grow
    cache.update(0, torch.randn(1, 40, 2, 4), torch.randn(1, 40, 2, 4))
    assert len(cache.keys.table[0]) == 3
    assert 3 * per_block <= cache.nbytes() <= 2 * 3 * per_block  # the pool grows by doubling


def test_a_million_token_context_costs_one_block_up_front():
    cache = LatentCache(1, MILLION, 576, "fp8")
    ring = cache_module.EXACT_RECENT * 576 * 4  # the newest positions, exact (fp32)
    assert cache.nbytes() == cache_module.BLOCK_TOKENS * (576 + 4) + ring
    assert cache.bytes_per_token() == 576 + 4


def test_trim_releases_blocks_and_reuse_keeps_the_batch1_view(small_blocks):
    buf = PagedBuffer(1, 200, 2, 5, "float32")
    x = torch.randn(1, 2, 100, 5)
    buf.write(0, x)
    buf.trim(20)  # keeps blocks 0 and 1 (positions 0..31), frees 2..6
    assert buf.table[0] == [0, 1] and sorted(buf.free) == [2, 3, 4, 5, 6]
    y = torch.randn(1, 2, 60, 5)
    buf.write(20, y)
    assert buf.table[0] == [0, 1, 2, 3, 4] and buf._flat is not None  # smallest free ids first: still a view
    assert torch.equal(buf.read(80), torch.cat([x[:, :, :20], y], dim=2))


def test_trim_after_batch_gather_reads_correctly(small_blocks):
    buf = PagedBuffer(2, 100, 3, 5, "fp8")
    x = torch.randn(2, 3, 50, 5)
    buf.write(0, x)
    buf.trim(17)
    y = torch.randn(2, 3, 30, 5)
    buf.write(17, y)
    want = torch.cat([x[:, :, :17], y], dim=2)
    # x's positions 18..49 were in the exact ring, but the trim dropped them: only y's 17..46 are exact
    assert torch.equal(buf.read(47), with_exact_tail(want, ROUND_TRIP["fp8"](want), 17))


def test_model_cache_trims_paged_layers_only_after_the_state_layers_agree(small_blocks):
    kv, state = KVCache(1, 1, 64, 4), DeltaStateCache(1, 1, 4, 4, 12, 4)
    cache = ModelCache([kv, state], 1, 64)
    kv.update(0, torch.randn(1, 40, 1, 4), torch.randn(1, 40, 1, 4))
    state.advance(torch.randn(1, 1, 4, 4), torch.randn(1, 3, 12), 40)
    cache.advance(40)
    with pytest.raises(StateRollbackError):
        cache.trim(10)
    assert cache.offset == 40 and len(kv.keys.table[0]) == 3  # the K/V blocks are still there


def test_unknown_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="fp8"):
        PagedBuffer(1, 8, 1, 4, "int4")


def _spec(family: str, config: dict):
    return family_for_model_type(config["model_type"]).spec_from_hf(config)


@pytest.mark.parametrize("family", ["gpt_oss", "kimi_linear", "kimi_k3"])
@pytest.mark.parametrize("dtype", KV_CACHE_DTYPES)
def test_spec_bytes_per_token_equal_what_the_layer_caches_store(family, dtype):
    from localmoe.engine.transformer import MIXERS
    from localmoe.testing import plan_checkpoint

    spec = _spec(family, plan_checkpoint(family, "tiny").config)
    total = 0
    for kind in spec.layer_kinds:
        if kind in ("attention", "sliding_attention"):
            total += KVCache(1, spec.num_kv_heads, 8, spec.head_dim, dtype).bytes_per_token()
        elif kind == "mla":
            total += LatentCache(1, 8, spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim, dtype).bytes_per_token()
        else:
            assert kind in MIXERS and kind == "kda"  # constant state: nothing per token
    assert spec.kv_bytes_per_token(dtype) == total > 0


def test_kimi_k3_real_config_has_the_published_dimensions():
    config = json.loads(K3_REAL.read_text())
    spec = _spec("kimi_k3", config)
    assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (93, 7168, 163840)
    assert spec.layer_kinds.count("mla") == 24 and spec.layer_kinds.count("kda") == 69
    assert [i + 1 for i, k in enumerate(spec.layer_kinds) if k == "mla"] == [*range(4, 93, 4), 93]
    assert (spec.mla.kv_lora_rank, spec.mla.qk_rope_head_dim, spec.mla.qk_nope_head_dim, spec.mla.v_head_dim) == \
        (512, 64, 128, 128)
    assert (spec.num_experts, spec.num_experts_per_tok, spec.moe_intermediate_size) == (896, 16, 3072)
    assert spec.max_position_embeddings == MILLION
    assert spec.mlp_kinds[0] == "dense" and spec.intermediate_size == 33792


def test_kimi_k3_fp8_cache_at_a_million_tokens_fits_in_32_gb():
    spec = _spec("kimi_k3", json.loads(K3_REAL.read_text()))
    per_token = spec.kv_bytes_per_token("fp8")
    assert per_token == 24 * (512 + 64 + 4)  # 24 MLA layers x (576 fp8 values + one fp32 scale)
    state = 69 * state_bytes(spec.kda)
    assert state == 69 * 4 * (96 * 128 * 128 + 3 * 3 * 96 * 128)  # fp32 state + 3-tap conv tails of q, k, v
    total = per_token * MILLION + state
    print(f"K3 at 1M tokens: fp8 latents {per_token * MILLION / 1e9:.2f} GB + delta state {state / 1e9:.2f} GB "
          f"= {total / 1e9:.2f} GB (fp32 cache: {spec.kv_bytes_per_token('float32') * MILLION / 1e9:.1f} GB)")
    assert total <= 32e9
    assert spec.kv_bytes_per_token("float32") * MILLION > 32e9  # without fp8 it would not fit


def test_fp32_single_sequence_reads_are_views_of_the_pool(small_blocks):
    cache = KVCache(1, 2, 500, 8)
    k = torch.randn(1, 40, 2, 8)  # [B, T, H_kv, D], as attention passes it
    keys, _ = cache.update(0, k, k)
    keys, _ = cache.update(40, k[:, :1], k[:, :1])  # a decode step
    assert keys.shape == (1, 2, 41, 8) and keys.data_ptr() == cache.keys.pool.data_ptr()  # no copy
    assert keys.stride(-2) == 8  # one head's positions are contiguous rows (what SDPA reads fastest)
    assert torch.equal(keys[:, :, :40], k.transpose(1, 2))


def test_trim_of_an_fp32_cache_runs_no_tensor_op_where_no_block_is_released(small_blocks):
    """A verify's rejected drafts trim every layer after each such step: for fp32 K/V with nothing to release it
    must cost no tensor op (it did: a masked fill of the empty exact ring per buffer); fp8 still clears its ring."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    def ops_of_trim(dtype: str, offset: int) -> int:
        layers = [KVCache(1, 2, 64, 4, dtype) for _ in range(3)]
        cache = ModelCache(layers, 1, 64)
        for layer in layers:
            layer.update(0, torch.randn(1, 12, 2, 4), torch.randn(1, 12, 2, 4))
        cache.advance(12)
        Count.ops = 0
        with Count():
            cache.trim(offset)
        assert cache.offset == offset
        return Count.ops

    assert ops_of_trim("float32", 9) == 0  # the block holding 0..15 stays: nothing to do
    assert ops_of_trim("fp8", 9) > 0  # the exact ring forgets 9..11
