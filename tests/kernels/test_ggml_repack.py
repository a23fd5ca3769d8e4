"""Q4_K rows repacked at load (Q4_K_R8, kernels/ggml_gemv/repacked.py): the same bytes back, and the same bits as the
GGUF layout out of every kernel path (one token, tiles of tokens, bias, whole-group slices, the fused MoE calls), the
reference and the dequantiser reading it through its GGUF layout, and the loader's choice of what to repack."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from localmoe.kernels.ggml_gemv import KERNEL_TYPES, TYPES, ggml_gemv, kernel_available, naive_ggml_gemv
from localmoe.kernels.ggml_gemv.repacked import Q4_K_R8, can_repack, plain_type, repack, unpack

from localmoe.engine.quantized import BlockQuantized, repack_blocks
from localmoe.testing.ggml_blocks import random_blocks

needs_cpu_kernel = pytest.mark.skipif(not kernel_available(), reason="CPU kernel unavailable (no AVX2 or compiler)")
Q = gguf.GGMLQuantizationType


def _q4k(O: int, K: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(Q.Q4_K, O, K, np.random.default_rng(seed)))


@needs_cpu_kernel
def test_repack_round_trips_in_place_and_not():
    raw = _q4k(24, 768, seed=1)
    packed, kind = repack(raw, Q.Q4_K, 24)
    assert kind == Q4_K_R8 and kind in KERNEL_TYPES and kind not in TYPES and plain_type(kind) == Q.Q4_K
    assert kind.name == "Q4_K_R8" and int(kind) == 0x100 | int(Q.Q4_K)
    assert packed.shape == raw.shape and not torch.equal(packed, raw)
    assert torch.equal(unpack(packed, kind, 24), raw)
    assert torch.equal(packed[8:16], repack(raw[8:16].contiguous(), Q.Q4_K, 8)[0])  # groups of eight stay in place
    inplace = raw.clone()
    repack(inplace, Q.Q4_K, 24, out=inplace)
    assert torch.equal(inplace, packed)
    assert unpack(raw, Q.Q4_K, 24) is raw  # plain bytes as they are
    assert not can_repack(Q.Q4_K, 20, 768) and not can_repack(Q.Q6_K, 24, 768) and can_repack(Q.Q4_K, 24, 768)
    with pytest.raises(ValueError, match="no repacked form"):
        repack(_q4k(12, 256, seed=2), Q.Q4_K, 12)


@needs_cpu_kernel
@pytest.mark.parametrize("N", [1, 2, 3, 8, 9, 17], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("O,K", [(8, 256), (40, 768), (136, 1024)], ids=["8x256", "40x768", "136x1024"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_same_bits_as_the_gguf_layout(N, O, K, bias):
    """One token (group8_r8_one), tiles of 2..8 tokens and their remainders (group8_qk on the repacked bytes), an O
    past the thread chunks: bit for bit the GGUF layout's rows (which tests/kernels/test_ggml_gemv.py checks against
    float64)."""
    raw = _q4k(O, K, seed=O + K)
    packed, kind = repack(raw, Q.Q4_K, O)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    x[:, 3] *= 25
    b = torch.randn(O) if bias else None
    want = ggml_gemv(x, raw, Q.Q4_K, (O, K), b)
    assert torch.equal(ggml_gemv(x, packed, kind, (O, K), b), want)
    for first, last in ((0, 8), (8, O)):  # whole groups of a repacked matrix are its rows' slice
        if last > first:
            part = ggml_gemv(x, packed[first:last].contiguous(), kind, (last - first, K))
            assert torch.equal(part, ggml_gemv(x, raw[first:last].contiguous(), Q.Q4_K, (last - first, K)))
    assert torch.equal(naive_ggml_gemv(x.double(), packed, kind, (O, K), b), naive_ggml_gemv(x.double(), raw, Q.Q4_K,
                                                                                              (O, K), b))


@needs_cpu_kernel
def test_threads_do_not_change_the_bits():
    raw = _q4k(264, 512, seed=5)
    packed, kind = repack(raw, Q.Q4_K, 264)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ggml_gemv(x, raw, Q.Q4_K, (264, 512))
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(ggml_gemv(x, packed, kind, (264, 512)), want), f"{n} threads"
            assert torch.equal(ggml_gemv(x[:1].contiguous(), packed, kind, (264, 512)), want[:1]), f"{n} threads"
    finally:
        torch.set_num_threads(before)


@needs_cpu_kernel
def test_fused_moe_calls_give_the_bits_of_the_gguf_layout():
    """ggml_moe_token (the fused decode step's experts), block_expert and block_layer (prefill) over repacked gate and
    up (Q4_K) beside a plain Q6_K down: the bits of the same experts in the GGUF layout."""
    from localmoe.kernels.ggml_gemv.experts import BlockExpertTable, block_expert, block_layer, ggml_moe_token
    from localmoe.kernels.mxfp4_moe import GLU_KINDS

    W, I, E = 512, 256, 4
    rng = np.random.default_rng(7)

    def expert(e):
        return (BlockQuantized(_q4k(I, W, 10 * e), Q.Q4_K, (I, W)),
                BlockQuantized(_q4k(I, W, 10 * e + 1), Q.Q4_K, (I, W)),
                BlockQuantized(torch.from_numpy(random_blocks(Q.Q6_K, W, I, rng)), Q.Q6_K, (W, I)))

    plain = [expert(e) for e in range(E)]
    packed = [tuple(BlockQuantized(*repack(m.raw, m.ggml_type, m.shape[0]), m.shape) if m.ggml_type == Q.Q4_K else m
                    for m in mats) for mats in plain]
    tables = [BlockExpertTable.of(plain), BlockExpertTable.of(packed)]
    assert tables[1] is not None and tables[1].types[0] == Q4_K_R8
    kind, params = GLU_KINDS.index("swiglu"), (0.0, 0.0)
    x = torch.randn(6, W, generator=torch.Generator().manual_seed(8))
    outs = []
    for table, mats in zip(tables, (plain, packed)):
        one = ggml_moe_token(x[0].contiguous(), [1, 3], [0.25, 0.75], table, kind, params, torch.zeros(W))
        rows = block_expert(x, torch.tensor([0, 2, 5]), torch.tensor([0.5, 1.0, 2.0]), mats[2], kind, params,
                            torch.zeros(6, W))
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
        layer = block_layer(x, ids, torch.rand(6, 2, generator=torch.Generator().manual_seed(9)), table, [0, 1, 2, 3],
                            kind, params, torch.zeros(6, W))
        outs.append((one, rows, layer))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@needs_cpu_kernel
def test_block_weights_read_through_their_gguf_layout():
    raw = _q4k(16, 512, seed=11)
    plain = BlockQuantized(raw, Q.Q4_K, (16, 512))
    packed = BlockQuantized(*repack(raw, Q.Q4_K, 16), (16, 512))
    assert torch.equal(packed.float(), plain.float())
    with pytest.raises(ValueError, match="reorder them before repacking"):
        packed.map_rows(lambda rows: rows.flip(0))


@needs_cpu_kernel
def test_the_loader_repacks_what_the_row_kernels_read():
    """Q4_K matrices of whole groups of eight rows, not the embedding nor the lm_head (read a row at a time or on fp32
    inputs), nor other types or shapes."""
    weights = {"embed_tokens.weight": BlockQuantized(_q4k(16, 256, 1), Q.Q4_K, (16, 256)),
               "lm_head.weight": BlockQuantized(_q4k(16, 256, 2), Q.Q4_K, (16, 256)),
               "layers.0.self_attn.q_proj.weight": BlockQuantized(_q4k(16, 256, 3), Q.Q4_K, (16, 256)),
               "layers.0.self_attn.k_proj.weight": BlockQuantized(_q4k(12, 256, 4), Q.Q4_K, (12, 256)),
               "layers.0.mlp.down_proj.weight": BlockQuantized(torch.from_numpy(random_blocks(
                   Q.Q6_K, 16, 256, np.random.default_rng(5))), Q.Q6_K, (16, 256)),
               "norm.weight": torch.ones(256)}
    kinds = {name: getattr(t, "ggml_type", None) for name, t in repack_blocks(dict(weights)).items()}
    assert kinds == {"embed_tokens.weight": Q.Q4_K, "lm_head.weight": Q.Q4_K,
                     "layers.0.self_attn.q_proj.weight": Q4_K_R8, "layers.0.self_attn.k_proj.weight": Q.Q4_K,
                     "layers.0.mlp.down_proj.weight": Q.Q6_K, "norm.weight": None}
