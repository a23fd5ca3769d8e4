"""Dequantisation of ggml tensor types in PyTorch: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4, IQ4_NL and IQ4_XS here; the lattice (IQ1_S ... IQ3_S) and ternary
(TQ1_0, TQ2_0) types in quant/ggml_iq.py.

Each block decoder takes `blocks: [N, type_size] uint8` (N blocks of raw bytes) and writes
`out: [N, block_size] float32`. The arithmetic mirrors the numpy reference in
`gguf.quants` operation for operation (same products, same order, no fused multiply-add),
so results are bit-identical to it. Large tensors are decoded in chunks of blocks so the
intermediates stay in cache; there is no Python loop over blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from localmoe.errors import CheckpointError
from localmoe.quant.ggml_bits import aligned, bit_fields, f16_fields, on, u16_fields
from localmoe.quant.ggml_iq import IQ_DECODERS

T = GGMLQuantizationType
QK_K = 256  # super-block size of the k-quants
_CHUNK_ELEMENTS = 1 << 22  # values decoded per chunk (16 MiB of float32): bounds the temporaries

FLOAT_TYPES = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """`[N, 16]` bytes -> `[N, 32]`: the 16 low nibbles, then the 16 high nibbles."""
    return bit_fields(qs.unsqueeze(1), (0, 4), 0x0F).reshape(qs.shape[0], -1)


def _q4_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_0: d f16 | qs[16]; value = d * (nibble - 8)
    d = f16_fields(blocks, 0)
    out.copy_(_nibbles(blocks[:, 2:]))
    out.sub_(8.0).mul_(d)


def _q4_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_1: d f16 | m f16 | qs[16]; value = d * nibble + m
    dm = f16_fields(blocks, 0, 2)
    d, m = dm[:, :1], dm[:, 1:]
    out.copy_(_nibbles(blocks[:, 4:]))
    out.mul_(d).add_(m)


_BIT_INDEX = torch.arange(32, dtype=torch.int32)


def _fifth_bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32-bit field of Q5_0 / Q5_1 `[N, 4]` -> `[N, 32]` uint8: bit j (element j's fifth bit)."""
    words = aligned(qh, 4).view(torch.int32)  # [N, 1]; bit 31 shifts in ones, the mask drops them
    return ((words >> on(_BIT_INDEX, words.device)) & 1).to(torch.uint8)


def _q5_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_0: d f16 | qh[4] (fifth bits) | qs[16] (nibbles as Q4_0); value = d * (q - 16), q in 0..31
    d = f16_fields(blocks, 0)
    out.copy_(_nibbles(blocks[:, 6:]) | (_fifth_bits(blocks[:, 2:6]) << 4))
    out.sub_(16.0).mul_(d)


def _q5_1(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_1: d f16 | m f16 | qh[4] | qs[16]; value = d * q + m
    dm = f16_fields(blocks, 0, 2)
    out.copy_(_nibbles(blocks[:, 8:]) | (_fifth_bits(blocks[:, 4:8]) << 4))
    out.mul_(dm[:, :1]).add_(dm[:, 1:])


def _q8_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q8_0: d f16 | qs[32] int8; value = d * q
    d = f16_fields(blocks, 0)
    out.copy_(blocks[:, 2:].view(torch.int8))
    out.mul_(d)


def _k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 12 packed bytes of Q4_K/Q5_K -> 8 six-bit scales and 8 six-bit mins, `[N, 8]` each.

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3, and 8-11 the low 4 bits of
    scales/mins 4-7, whose top 2 bits sit in the top bits of bytes 0-3 / 4-7.
    """
    scales = scales.reshape(-1, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q4_K (256 values): d f16 | dmin f16 | scales[12] | qs[128]
    # 8 sub-blocks of 32: value = (d * sc) * nibble - (dmin * m)
    n = blocks.shape[0]
    dd = f16_fields(blocks, 0, 2)
    d, dmin = dd[:, :1], dd[:, 1:]
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).unsqueeze(-1)  # [N, 8, 1]
    offset = (dmin * mn.to(torch.float32)).unsqueeze(-1)  # [N, 8, 1]
    # each 32 bytes hold two sub-blocks: low nibbles first, then high nibbles
    qs = bit_fields(blocks[:, 16:].reshape(n, 4, 32), (0, 4), 0x0F)  # [N, 4, 2, 32]
    view = out.view(n, 8, 32)
    view.copy_(qs.reshape(n, 8, 32))
    view.mul_(scale).sub_(offset)


def _q5_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q5_K (256 values): d f16 | dmin f16 | scales[12] (as Q4_K) | qh[32] | qs[128] (as Q4_K)
    # sub-block j: value = (d * sc) * q - (dmin * m), q = nibble | bit j of qh[i] << 4 for element i
    n = blocks.shape[0]
    dd = f16_fields(blocks, 0, 2)
    sc, mn = _k_scale_min(blocks[:, 4:16])
    scale = (dd[:, :1] * sc.to(torch.float32)).unsqueeze(-1)  # [N, 8, 1]
    offset = (dd[:, 1:] * mn.to(torch.float32)).unsqueeze(-1)
    low = bit_fields(blocks[:, 48:].reshape(n, 4, 32), (0, 4), 0x0F).reshape(n, 8, 32)
    high = bit_fields(blocks[:, 16:48].reshape(n, 1, 32), range(8), 0x01).reshape(n, 8, 32)
    view = out.view(n, 8, 32)
    view.copy_(low | (high << 4))
    view.mul_(scale).sub_(offset)


def _q2_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q2_K (256 values): scales[16] (low 4 bits scale, high 4 bits min) | qs[64] | d f16 | dmin f16
    # 16 sub-blocks of 16: value = (d * scale) * q - (dmin * min), q in 0..3 (2 bits of qs)
    n = blocks.shape[0]
    sc = blocks[:, :16]
    dd = f16_fields(blocks, 80, 2)
    scale = (dd[:, :1] * (sc & 0x0F).to(torch.float32)).unsqueeze(-1)  # [N, 16, 1]
    offset = (dd[:, 1:] * (sc >> 4).to(torch.float32)).unsqueeze(-1)
    view = out.view(n, 16, 16)
    view.copy_(bit_fields(blocks[:, 16:80].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16))
    view.mul_(scale).sub_(offset)


def _q3_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q3_K (256 values): hmask[32] | qs[64] (2 low bits) | scales[12] (16 six-bit, - 32) | d f16
    # value = (d * scale) * (q - 4 * (1 - hbit)): the offset 4 applies where the hmask bit is CLEAR
    n = blocks.shape[0]
    d = f16_fields(blocks, 108)
    low = bit_fields(blocks[:, 96:104].reshape(n, 1, 8), (0, 4), 0x0F).reshape(n, 16)  # scales 0-7, then 8-15
    high = bit_fields(blocks[:, 104:108].reshape(n, 1, 4), (0, 2, 4, 6), 0x03).reshape(n, 16)
    scale = (d * ((low | (high << 4)).to(torch.float32) - 32.0)).unsqueeze(-1)  # [N, 16, 1]
    q = bit_fields(blocks[:, 32:96].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 16, 16).to(torch.float32)
    hbit = bit_fields(blocks[:, :32].reshape(n, 1, 32), range(8), 0x01).reshape(n, 16, 16)
    view = out.view(n, 16, 16)
    view.copy_(q.sub_(4.0 * (1 - hbit).to(torch.float32)))
    view.mul_(scale)


def _q6_k(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_q6_K (256 values): ql[128] (low 4 bits) | qh[64] (high 2 bits) | scales[16] int8 | d f16
    # 16 sub-blocks of 16: value = (d * scale) * (q - 32), q in 0..63
    n = blocks.shape[0]
    # values 0-127 of the block come from bytes 0-63 of ql and 0-31 of qh, 128-255 from the rest
    ql = bit_fields(blocks[:, :128].reshape(n, 2, 64), (0, 4), 0x0F).reshape(n, 8, 32)
    qh = bit_fields(blocks[:, 128:192].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    scale = f16_fields(blocks, 208) * blocks[:, 192:208].view(torch.int8).to(torch.float32)  # [N, 16]
    view = out.view(n, 16, 16)
    view.copy_(q.reshape(n, 16, 16))
    view.mul_(scale.unsqueeze(-1))


# E2M1 values doubled (ggml's kvalues_mxfp4); bit 3 is the sign
_MXFP4_KVALUES = torch.tensor([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=torch.float32)


def _e8m0_half_table() -> torch.Tensor:
    """float32 2^(e - 128) for every E8M0 byte e (ggml_e8m0_to_fp32_half).

    Half the E8M0 scale 2^(e - 127), to pair with the doubled E2M1 values; e = 0 and 1
    give the float32 subnormals 2^-128 and 2^-127.
    """
    e = torch.arange(256, dtype=torch.int32)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23)
    return bits.view(torch.float32)


_E8M0_HALF = _e8m0_half_table()


def _mxfp4(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_mxfp4: e E8M0 | qs[16]; element j in the low nibble of byte j, j + 16 in the high one
    # value = 2^(e - 128) * kvalues[nibble] = 2^(e - 127) * e2m1(nibble)
    d = on(_E8M0_HALF, blocks.device)[blocks[:, 0].long()].unsqueeze(-1)  # [N, 1]
    out.copy_(on(_MXFP4_KVALUES, blocks.device).take(_nibbles(blocks[:, 1:]).long()))
    out.mul_(d)


# the 16 non-uniform 4-bit levels of IQ4_NL and IQ4_XS (ggml's kvalues_iq4nl)
_IQ4_KVALUES = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113],
                            dtype=torch.float32)


def _iq4_nl(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq4_nl (32 values): d f16 | qs[16]; element j in the low nibble of byte j, j + 16 in the high one
    # value = d * kvalues[nibble]
    out.copy_(on(_IQ4_KVALUES, blocks.device).take(_nibbles(blocks[:, 2:]).long()))
    out.mul_(f16_fields(blocks, 0))


def _iq4_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq4_xs (256 values): d f16 | scales_h u16 | scales_l[4] | qs[128]; 8 sub-blocks of 32, each as an
    # IQ4_NL block with the step (d * (ls - 32)), ls = 4 low bits from scales_l, 2 high bits from scales_h
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)  # [N, 1]
    h = u16_fields(blocks, 2, 1)  # [N, 1]
    high = torch.stack([(h >> (2 * i)) & 3 for i in range(8)], dim=1).reshape(n, 8)
    lo = blocks[:, 4:8].to(torch.int32)
    low = torch.stack([lo & 0x0F, lo >> 4], dim=-1).reshape(n, 8)
    dl = (d * ((low | (high << 4)) - 32).to(torch.float32)).unsqueeze(-1)  # [N, 8, 1]
    q = bit_fields(blocks[:, 8:].reshape(n, 8, 16), (0, 4), 0x0F).reshape(n, 8, 32)
    view = out.view(n, 8, 32)
    view.copy_(on(_IQ4_KVALUES, blocks.device).take(q.long()))
    view.mul_(dl)


_BLOCK_DECODERS: dict[GGMLQuantizationType, Callable[[torch.Tensor, torch.Tensor], None]] = {
    T.Q4_0: _q4_0,
    T.Q4_1: _q4_1,
    T.Q5_0: _q5_0,
    T.Q5_1: _q5_1,
    T.Q8_0: _q8_0,
    T.Q2_K: _q2_k,
    T.Q3_K: _q3_k,
    T.Q4_K: _q4_k,
    T.Q5_K: _q5_k,
    T.Q6_K: _q6_k,
    T.MXFP4: _mxfp4,
    T.IQ4_NL: _iq4_nl,
    T.IQ4_XS: _iq4_xs,
    **IQ_DECODERS,
}

SUPPORTED_TYPES: tuple[GGMLQuantizationType, ...] = (*FLOAT_TYPES, *_BLOCK_DECODERS)


def is_supported(ggml_type: GGMLQuantizationType) -> bool:
    """Whether `dequantize` can decode this ggml type."""
    return ggml_type in FLOAT_TYPES or ggml_type in _BLOCK_DECODERS


def _type_name(ggml_type: object) -> str:
    return getattr(ggml_type, "name", str(ggml_type))


def dequantize(raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: Sequence[int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decode the stored bytes of one ggml tensor into a `dtype` tensor of `shape`.

    raw: the tensor's bytes (uint8, any shape, ggml layout: blocks run along the last
    PyTorch dimension). shape: PyTorch order, outermost first (reversed ggml `ne`).
    F32/F16/BF16 with a matching `dtype` come back as zero-copy views of `raw`.
    Raises CheckpointError for an unsupported type or a byte count that does not match.
    """
    shape = tuple(int(s) for s in shape)
    if not is_supported(ggml_type):
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise CheckpointError(f"ggml tensor type {_type_name(ggml_type)} is not supported; "
                              f"supported types: {supported}")
    if raw.dtype != torch.uint8:
        raw = raw.contiguous().view(torch.uint8)
    block_size, type_size = GGML_QUANT_SIZES[ggml_type]
    n_values = math.prod(shape)
    if shape and shape[-1] % block_size != 0:
        raise CheckpointError(f"a {ggml_type.name} tensor of shape {shape} has rows of {shape[-1]} values, "
                              f"not a multiple of the {block_size}-value block")
    n_bytes = n_values // block_size * type_size
    if raw.numel() != n_bytes:
        raise CheckpointError(f"a {ggml_type.name} tensor of shape {shape} needs {n_bytes} bytes, got {raw.numel()}")

    if ggml_type in FLOAT_TYPES:
        stored = FLOAT_TYPES[ggml_type]
        return aligned(raw.reshape(-1), stored.itemsize).view(stored).reshape(shape).to(dtype)

    blocks = raw.reshape(-1, type_size)  # [N, type_size]
    n_blocks = blocks.shape[0]
    out = torch.empty(n_blocks, block_size, dtype=torch.float32, device=raw.device)  # [N, block_size]
    decode = _BLOCK_DECODERS[ggml_type]
    step = max(1, _CHUNK_ELEMENTS // block_size)  # blocks per chunk
    for start in range(0, n_blocks, step):
        decode(blocks[start:start + step], out[start:start + step])
    return out.reshape(shape).to(dtype)
