"""Q4_1, Q4_K and Q6_K rows repacked at load (Q4_1_R8, Q4_K_R8, Q6_K_R8, kernels/ggml_gemv/repacked.py), and a Q8_0
x16 head (Q8_0_R16): the same bytes back, and the same bits as the GGUF layout out of every kernel path (one token,
tiles of tokens, bias, whole-group slices, the fused MoE calls), the reference and the dequantiser reading it through
its GGUF layout, and the loader's choice of what to repack."""

from __future__ import annotations

import mmap

import gguf
import numpy as np
import pytest
import torch
from localmoe.kernels.ggml_gemv import KERNEL_TYPES, TYPES, dequantize_row, dequantize_rows, ggml_gemv, kernel_available, \
    naive_ggml_gemv
from localmoe.kernels._cpu.pages import on_huge_pages
from localmoe.kernels.ggml_gemv.repacked import Q4_1_R8, Q4_K_R8, Q6_K_R8, Q8_0_R16, REPACKED, can_repack, plain_type, repack, \
    unpack

from localmoe.engine.quantized import BlockEmbedding, BlockQuantized, repack_blocks
from localmoe.testing.ggml_blocks import random_blocks

needs_cpu_kernel = pytest.mark.skipif(not kernel_available(), reason="CPU kernel unavailable (no AVX2 or compiler)")
Q = gguf.GGMLQuantizationType


PLAIN = sorted(REPACKED, key=int)  # Q4_1, Q4_K, Q6_K
by_name = pytest.mark.parametrize("plain", PLAIN, ids=lambda t: t.name)


def _blocks(t, O: int, K: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_blocks(t, O, K, np.random.default_rng(seed)))


def _q4k(O: int, K: int, seed: int) -> torch.Tensor:
    return _blocks(Q.Q4_K, O, K, seed)


@needs_cpu_kernel
@by_name
def test_repack_round_trips_in_place_and_not(plain):
    raw = _blocks(plain, 24, 768, seed=1)
    packed, kind = repack(raw, plain, 24)
    assert kind == REPACKED[plain] and kind in KERNEL_TYPES and kind not in TYPES and plain_type(kind) == plain
    assert kind.name == f"{plain.name}_R8" and int(kind) == 0x100 | int(plain)
    assert packed.shape == raw.shape and not torch.equal(packed, raw)
    assert torch.equal(unpack(packed, kind, 24), raw)
    assert torch.equal(packed[8:16], repack(raw[8:16].contiguous(), plain, 8)[0])  # groups of eight stay in place
    inplace = raw.clone()
    repack(inplace, plain, 24, out=inplace)
    assert torch.equal(inplace, packed)
    assert unpack(raw, plain, 24) is raw  # plain bytes as they are
    assert not can_repack(plain, 20, 768) and not can_repack(Q.Q5_K, 24, 768) and can_repack(plain, 24, 768)
    with pytest.raises(ValueError, match="no repacked form"):
        repack(_blocks(plain, 12, 256, seed=2), plain, 12)


@needs_cpu_kernel
def test_q6_k_repacked_bytes_hold_the_codes_where_the_kernel_reads_them():
    """Q6_K_R8's layout spelled out (ggml_rows8_q6k.h): the rows' d, their int8 scales transposed, then per 16 values
    three vectors of four bytes a row, codes in bits 0-5 and the fourth quarter's code in the top two bits."""
    O, K = 8, 256
    raw = _blocks(Q.Q6_K, O, K, seed=3)
    packed = repack(raw, Q.Q6_K, O)[0].numpy().reshape(-1).astype(np.int64)
    blk = raw.numpy().astype(np.int64)
    v = np.arange(256)
    c, i = v // 32, v % 32
    h, s = c // 4, c % 4
    ql = blk[:, 64 * h + 32 * (s % 2) + i] >> np.where(s >= 2, 4, 0) & 0x0F
    qh = blk[:, 128 + 32 * h + i] >> 2 * s & 3
    codes = ql | qh << 4  # [8 rows, 256]
    assert np.array_equal(packed[:16].reshape(8, 2), blk[:, 208:210])
    assert np.array_equal(packed[16:144].reshape(4, 8, 4).transpose(1, 0, 2).reshape(8, 16), blk[:, 192:208])
    vecs = packed[144:].reshape(16, 3, 8, 4)  # [sub-block j, m, row r, byte b]
    for m in range(3):
        assert np.array_equal(vecs[:, m] & 0x3F, codes.reshape(8, 16, 4, 4)[:, :, m].transpose(1, 0, 2))
    last = sum((vecs[:, m] >> 6) << 2 * m for m in range(3))
    assert np.array_equal(last, codes.reshape(8, 16, 4, 4)[:, :, 3].transpose(1, 0, 2))


@needs_cpu_kernel
def test_q4_1_repacked_bytes_hold_the_blocks_where_the_kernel_reads_them():
    """Q4_1_R8's layout spelled out (ggml_rows.h Rows8R8): per block of 32 values, the eight rows' (d, m) dwords, then
    four vectors whose lane r holds row r's code bytes 4k .. 4k + 3."""
    O, K = 16, 96
    raw = _blocks(Q.Q4_1, O, K, seed=4)
    packed = repack(raw, Q.Q4_1, O)[0].numpy().reshape(O // 8, K // 32, 5, 8, 4)  # [group, block, dword, row, byte]
    plain = raw.numpy().reshape(O // 8, 8, K // 32, 5, 4)  # [group, row, block, dword, byte]
    assert np.array_equal(packed, plain.transpose(0, 2, 3, 1, 4))


@needs_cpu_kernel
@by_name
@pytest.mark.parametrize("N", [1, 2, 3, 8, 9, 17], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("O,K", [(8, 256), (40, 768), (136, 1024)], ids=["8x256", "40x768", "136x1024"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_same_bits_as_the_gguf_layout(plain, N, O, K, bias):
    """One token (Q4_1: group8 on the repacked block; Q4_K: group8_r8_one; Q6_K: group8_q6r8<1>), tiles of 2..16 tokens
    and their remainders (Q4_1: sixteen rows a vector on AVX-512), an O past the thread chunks: bit for bit the GGUF
    layout's rows (which tests/kernels/test_ggml_gemv.py checks against float64)."""
    raw = _blocks(plain, O, K, seed=O + K)
    packed, kind = repack(raw, plain, O)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    x[:, 3] *= 25
    b = torch.randn(O) if bias else None
    want = ggml_gemv(x, raw, plain, (O, K), b)
    assert torch.equal(ggml_gemv(x, packed, kind, (O, K), b), want)
    for first, last in ((0, 8), (8, O)):  # whole groups of a repacked matrix are its rows' slice
        if last > first:
            part = ggml_gemv(x, packed[first:last].contiguous(), kind, (last - first, K))
            assert torch.equal(part, ggml_gemv(x, raw[first:last].contiguous(), plain, (last - first, K)))
    assert torch.equal(naive_ggml_gemv(x.double(), packed, kind, (O, K), b), naive_ggml_gemv(x.double(), raw, plain,
                                                                                              (O, K), b))


@needs_cpu_kernel
@by_name
def test_threads_do_not_change_the_bits(plain):
    raw = _blocks(plain, 264, 512, seed=5)
    packed, kind = repack(raw, plain, 264)
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(6))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ggml_gemv(x, raw, plain, (264, 512))
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(ggml_gemv(x, packed, kind, (264, 512)), want), f"{n} threads"
            assert torch.equal(ggml_gemv(x[:1].contiguous(), packed, kind, (264, 512)), want[:1]), f"{n} threads"
    finally:
        torch.set_num_threads(before)


@needs_cpu_kernel
def test_fused_moe_calls_give_the_bits_of_the_gguf_layout():
    """ggml_moe_token (the fused decode step's experts), block_expert and block_layer (prefill) over repacked gate and
    up (Q4_K) and down (Q6_K), or repacked gate and up beside a plain down: the bits of the same experts in the GGUF
    layout."""
    from localmoe.kernels.ggml_gemv.experts import BlockExpertTable, block_expert, block_layer, ggml_moe_token
    from localmoe.kernels.mxfp4_moe import GLU_KINDS

    W, I, E = 512, 256, 4
    rng = np.random.default_rng(7)

    def expert(e):
        return (BlockQuantized(_q4k(I, W, 10 * e), Q.Q4_K, (I, W)),
                BlockQuantized(_q4k(I, W, 10 * e + 1), Q.Q4_K, (I, W)),
                BlockQuantized(torch.from_numpy(random_blocks(Q.Q6_K, W, I, rng)), Q.Q6_K, (W, I)))

    plain = [expert(e) for e in range(E)]
    packed = [tuple(BlockQuantized(*repack(m.raw, m.ggml_type, m.shape[0]), m.shape) for m in mats) for mats in plain]
    mixed = [(*mats[:2], plain_mats[2]) for mats, plain_mats in zip(packed, plain)]
    tables = [BlockExpertTable.of(plain), BlockExpertTable.of(packed), BlockExpertTable.of(mixed)]
    assert tables[1] is not None and tables[1].types[0] == Q4_K_R8 and tables[1].types[2] == Q6_K_R8
    assert tables[2] is not None and tables[2].types[2] == Q.Q6_K
    kind, params = GLU_KINDS.index("swiglu"), (0.0, 0.0)
    x = torch.randn(6, W, generator=torch.Generator().manual_seed(8))
    outs = []
    for table, mats in zip(tables, (plain, packed, mixed)):
        one = ggml_moe_token(x[0].contiguous(), [1, 3], [0.25, 0.75], table, kind, params, torch.zeros(W))
        rows = block_expert(x, torch.tensor([0, 2, 5]), torch.tensor([0.5, 1.0, 2.0]), mats[2], kind, params,
                            torch.zeros(6, W))
        ids = torch.tensor([[0, 1], [2, 3], [1, 2], [3, 0], [0, 2], [1, 3]])
        layer = block_layer(x, ids, torch.rand(6, 2, generator=torch.Generator().manual_seed(9)), table, [0, 1, 2, 3],
                            kind, params, torch.zeros(6, W))
        outs.append((one, rows, layer))
    for other in outs[1:]:
        for a, b in zip(outs[0], other):
            assert torch.equal(a, b)


@needs_cpu_kernel
@by_name
def test_block_weights_read_through_their_gguf_layout(plain):
    raw = _blocks(plain, 16, 512, seed=11)
    packed = BlockQuantized(*repack(raw, plain, 16), (16, 512))
    assert torch.equal(packed.float(), BlockQuantized(raw, plain, (16, 512)).float())
    with pytest.raises(ValueError, match="reorder them before repacking"):
        packed.map_rows(lambda rows: rows.flip(0))


@needs_cpu_kernel
@pytest.mark.parametrize("int8_head", [False, True], ids=["head-fp32", "head-int8"])
def test_the_loader_repacks_what_the_row_kernels_read(int8_head):
    """Q4_1, Q4_K and Q6_K matrices of whole groups of eight rows, not the embedding (read a row at a time), nor the lm_head
    unless it reads int8 inputs (no fp32-x / int16-x rows repacked), nor other types or shapes."""
    weights = {"embed_tokens.weight": BlockQuantized(_q4k(16, 256, 1), Q.Q4_K, (16, 256)),
               "lm_head.weight": BlockQuantized(_blocks(Q.Q6_K, 16, 256, 2), Q.Q6_K, (16, 256)),
               "layers.0.self_attn.q_proj.weight": BlockQuantized(_q4k(16, 256, 3), Q.Q4_K, (16, 256)),
               "layers.0.self_attn.k_proj.weight": BlockQuantized(_q4k(12, 256, 4), Q.Q4_K, (12, 256)),
               "layers.0.self_attn.v_proj.weight": BlockQuantized(_blocks(Q.Q5_K, 16, 256, 6), Q.Q5_K, (16, 256)),
               "layers.0.mlp.down_proj.weight": BlockQuantized(_blocks(Q.Q6_K, 16, 256, 5), Q.Q6_K, (16, 256)),
               "layers.1.mlp.up_proj.weight": BlockQuantized(_blocks(Q.Q4_1, 24, 96, 7), Q.Q4_1, (24, 96)),
               "layers.1.mlp.gate_proj.weight": BlockQuantized(_blocks(Q.Q4_1, 20, 96, 8), Q.Q4_1, (20, 96)),
               "norm.weight": torch.ones(256)}
    kinds = {name: getattr(t, "ggml_type", None) for name, t in repack_blocks(dict(weights), int8_head).items()}
    assert kinds == {"embed_tokens.weight": Q.Q4_K, "lm_head.weight": Q6_K_R8 if int8_head else Q.Q6_K,
                     "layers.0.self_attn.q_proj.weight": Q4_K_R8, "layers.0.self_attn.k_proj.weight": Q.Q4_K,
                     "layers.0.self_attn.v_proj.weight": Q.Q5_K, "layers.0.mlp.down_proj.weight": Q6_K_R8,
                     "layers.1.mlp.up_proj.weight": Q4_1_R8, "layers.1.mlp.gate_proj.weight": Q.Q4_1,
                     "norm.weight": None}


@needs_cpu_kernel
@by_name
def test_the_loader_puts_repacked_matrices_on_huge_pages(plain):
    """A decode token streams every repacked byte: the loader's copy lies on 2 MiB pages (kernels/_cpu/pages.py, where
    the system can advise them), holds what `repack` gives, and the file's bytes are left as they were."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        pytest.skip("no MADV_HUGEPAGE on this system")
    raw = _blocks(plain, 512, 1024, seed=13)  # an expert's gate: over pages.MIN_BYTES
    before = raw.clone()
    name = "layers.0.mlp.experts.0.gate_proj.weight"
    held = repack_blocks({name: BlockQuantized(raw, plain, (512, 1024))})[name]
    assert held.ggml_type == REPACKED[plain] and on_huge_pages(held.raw) and not on_huge_pages(raw)
    assert torch.equal(held.raw, repack(before, plain, 512)[0]) and torch.equal(raw, before)
    other = _blocks(Q.Q5_0, 512, 1024, seed=14)  # a type without a repacked form, read by the row kernels: copied
    weights = {name: BlockQuantized(other, Q.Q5_0, (512, 1024)),
               "embed_tokens.weight": BlockQuantized(raw, plain, (512, 1024))}  # read a row at a time: left
    held = repack_blocks(dict(weights, **{"lm_head.weight": BlockQuantized(other, Q.Q5_0, (512, 1024))}))
    assert held[name].ggml_type == Q.Q5_0 and on_huge_pages(held[name].raw) and torch.equal(held[name].raw, other)
    assert held["embed_tokens.weight"].raw is raw and on_huge_pages(held["lm_head.weight"].raw)  # a head left plain
    tied = repack_blocks(dict(weights))["embed_tokens.weight"]  # no lm_head: the head reads the embedding
    assert tied.ggml_type == plain and on_huge_pages(tied.raw) and torch.equal(tied.raw, raw)


@needs_cpu_kernel
def test_q8_0_x16_repack_round_trips_and_is_only_for_x16():
    raw = _blocks(Q.Q8_0, 48, 256, seed=21)
    packed, kind = repack(raw, Q.Q8_0, 48, x16=True)
    assert kind == Q8_0_R16 and kind.name == "Q8_0_R16" and int(kind) == 0x100 | int(Q.Q8_0) and plain_type(kind) == Q.Q8_0
    assert kind not in KERNEL_TYPES  # no int8 / fp32-x rows read it
    assert packed.shape == raw.shape and not torch.equal(packed, raw) and torch.equal(unpack(packed, kind, 48), raw)
    assert torch.equal(packed[16:32], repack(raw[16:32].contiguous(), Q.Q8_0, 16, x16=True)[0])  # groups stay put
    assert can_repack(Q.Q8_0, 48, 256, x16=True) and not can_repack(Q.Q8_0, 40, 256, x16=True)
    assert not can_repack(Q.Q8_0, 48, 256) and not can_repack(Q.Q4_1, 48, 256, x16=True)
    x = torch.randn(2, 256)  # int8 x, not a mode Q8_0_R16 has: the reference, through the GGUF layout
    assert torch.equal(ggml_gemv(x, packed, kind, (48, 256)), naive_ggml_gemv(x, raw, Q.Q8_0, (48, 256)))


@needs_cpu_kernel
def test_q8_0_r16_bytes_hold_the_blocks_where_the_kernel_reads_them():
    """Q8_0_R16's layout spelled out (ggml_rows.h repack_q80): per group of sixteen rows, block b's codes at 512 b as
    eight 64-byte vectors whose lane r holds row r's codes 4i .. 4i + 3, then the fp16 steps, block b's at 512 nb + 32 b."""
    O, K = 32, 96
    nb = K // 32
    raw = _blocks(Q.Q8_0, O, K, seed=22)
    packed = repack(raw, Q.Q8_0, O, x16=True)[0].numpy().reshape(O // 16, -1)  # [group, bytes]
    plain = raw.numpy().reshape(O // 16, 16, nb, 34)  # [group, row, block, byte]
    codes = packed[:, :512 * nb].reshape(O // 16, nb, 8, 16, 4)  # [group, block, vector i, row, byte]
    assert np.array_equal(codes, plain[..., 2:].reshape(O // 16, 16, nb, 8, 4).transpose(0, 2, 3, 1, 4))
    assert np.array_equal(packed[:, 512 * nb:].reshape(O // 16, nb, 16, 2), plain[..., :2].transpose(0, 2, 1, 3))


@needs_cpu_kernel
@pytest.mark.parametrize("N", [1, 2, 3, 5, 8, 9, 16, 17, 21], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("O,K", [(16, 256), (48, 576), (144, 1024)], ids=["16x256", "48x576", "144x1024"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
def test_q8_0_r16_same_bits_as_the_gguf_layout(N, O, K, bias):
    """The x16 rows on Q8_0_R16 (AVX-512: one token through int16 pairs, 2-16 tokens through x's bytes; AVX2: eight
    rows a vector, both halves a block at a time): bit for bit the GGUF layout's x16 rows (tests/kernels/
    test_ggml_gemv.py holds those to float64); whole groups of sixteen are the rows' slice; the reference reads it
    through its GGUF layout."""
    raw = _blocks(Q.Q8_0, O, K, seed=O + K + 1)
    packed, kind = repack(raw, Q.Q8_0, O, x16=True)
    x = torch.randn(N, K, generator=torch.Generator().manual_seed(N))
    x[:, 3] *= 25
    b = torch.randn(O) if bias else None
    want = ggml_gemv(x, raw, Q.Q8_0, (O, K), b, x16=True)
    assert torch.equal(ggml_gemv(x, packed, kind, (O, K), b, x16=True), want)
    if O > 16:
        part = ggml_gemv(x, packed[16:].contiguous(), kind, (O - 16, K), x16=True)
        assert torch.equal(part, ggml_gemv(x, raw[16:].contiguous(), Q.Q8_0, (O - 16, K), x16=True))
    assert torch.equal(naive_ggml_gemv(x.double(), packed, kind, (O, K), b, x16=True),
                       naive_ggml_gemv(x.double(), raw, Q.Q8_0, (O, K), b, x16=True))


@needs_cpu_kernel
def test_q8_0_r16_threads_do_not_change_the_bits():
    raw = _blocks(Q.Q8_0, 272, 512, seed=23)
    packed, kind = repack(raw, Q.Q8_0, 272, x16=True)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(24))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = ggml_gemv(x, raw, Q.Q8_0, (272, 512), x16=True)
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            assert torch.equal(ggml_gemv(x, packed, kind, (272, 512), x16=True), want), f"{n} threads"
            assert torch.equal(ggml_gemv(x[:1].contiguous(), packed, kind, (272, 512), x16=True), want[:1])
    finally:
        torch.set_num_threads(before)


@needs_cpu_kernel
def test_q8_0_r16_rows_dequantise_as_the_gguf_layout():
    """A tied x16 head's table is the embedding's: its lookups (ggml_cpu.cpp ggml_dequantize_rows on the groups) give
    the GGUF rows' values, and BlockEmbedding / float() read it so."""
    O, K = 48, 96
    raw = _blocks(Q.Q8_0, O, K, seed=25)
    packed, kind = repack(raw, Q.Q8_0, O, x16=True)
    ids = torch.tensor([0, 15, 16, 47, 5, 5, 33])
    want = dequantize_rows(raw, ids, Q.Q8_0, K)
    assert torch.equal(dequantize_rows(packed, ids, kind, K), want)
    assert torch.equal(dequantize_row(packed, 33, kind, K), want[-1])
    table = BlockEmbedding(BlockQuantized(packed, kind, (O, K)))
    assert torch.equal(table(ids), want) and torch.equal(table[16], want[2])
    assert torch.equal(BlockQuantized(packed, kind, (O, K)).float(), BlockQuantized(raw, Q.Q8_0, (O, K)).float())


@needs_cpu_kernel
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("head", ["int8", "int16", "fp32"])
def test_the_loader_repacks_an_x16_head(tied, head):
    """A Q8_0 head that reads int16 inputs becomes Q8_0_R16 (tied: the embedding's table with it, one copy); read as int8
    or fp32 it stays Q8_0, and an untied embedding stays as it is."""
    weights = {"embed_tokens.weight": BlockQuantized(_blocks(Q.Q8_0, 32, 256, 31), Q.Q8_0, (32, 256)),
               "layers.0.mlp.up_proj.weight": BlockQuantized(_blocks(Q.Q4_1, 24, 96, 32), Q.Q4_1, (24, 96))}
    if not tied:
        weights["lm_head.weight"] = BlockQuantized(_blocks(Q.Q8_0, 32, 256, 33), Q.Q8_0, (32, 256))
    out = repack_blocks(dict(weights), int8_head=head == "int8", x16_head=head == "int16")
    kinds = {name: t.ggml_type for name, t in out.items()}
    x16 = Q8_0_R16 if head == "int16" else Q.Q8_0
    assert kinds == {"embed_tokens.weight": x16 if tied else Q.Q8_0, "layers.0.mlp.up_proj.weight": Q4_1_R8,
                     **({} if tied else {"lm_head.weight": x16})}
    source = weights["embed_tokens.weight" if tied else "lm_head.weight"]
    assert torch.equal(out["embed_tokens.weight" if tied else "lm_head.weight"].float(), source.float())
