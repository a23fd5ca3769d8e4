"""Dequantisation of ggml's lattice types (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S) and
ternary types (TQ1_0, TQ2_0) in PyTorch, as quant/ggml.py does the others.

The IQ types store, per group of 8 (IQ1/IQ2) or 4 (IQ3) values, an index into a fixed grid of points
(llama.cpp's `iq*_grid` tables in ggml-common.h), per 8 values a sign pattern, and per 16 or 32
values a small scale. The grids come from the `gguf` package (`gguf.quants.<type>.grid_hex`, the same
tables packed into 2 or 3 bits per value), decoded here; the sign patterns `ksigns_iq2xs` are derived
(7 stored bits, the eighth makes the count of minus signs even).

Each decoder takes `blocks: [N, type_size] uint8` and writes `out: [N, 256] float32`, bit-identical
to `gguf.quants`' numpy dequantisers: the same products in the same order (a sign flips a product
exactly, so applying it to the grid value first changes no bit).
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType, quants

from localmoe.quant.ggml_bits import aligned, bit_fields, f16_fields, on, u16_fields, u32_fields

T = GGMLQuantizationType


def _grid(kind) -> torch.Tensor:
    """float32 `[points, values per point]`: gguf's packed grid of `kind` (a `gguf.quants` class) decoded,
    each value the level `kind.grid_map` names (llama.cpp's byte values, or -1/0/1 for IQ1)."""
    packed = torch.frombuffer(bytearray(bytes.fromhex(kind.grid_hex.decode())), dtype=torch.uint8).to(torch.int64)
    bits = (len(kind.grid_map) - 1).bit_length()  # 3 levels: 2 bits; 8 levels: 3 bits (one per nibble)
    per_byte = 8 // bits
    step = 8 // per_byte
    codes = torch.stack([(packed >> (i * step)) & ((1 << bits) - 1) for i in range(per_byte)], dim=1)
    return torch.tensor(kind.grid_map, dtype=torch.float32)[codes.reshape(kind.grid_shape)]


def _sign_table() -> torch.Tensor:
    """float32 `[128, 8]`: the 8 signs (+1 / -1) of each 7-bit sign index (ksigns_iq2xs: bit j of
    `i | parity(i) << 7` set means minus)."""
    i = torch.arange(128)
    parity = torch.stack([(i >> b) & 1 for b in range(7)]).sum(0) & 1
    pattern = i | (parity << 7)
    return 1.0 - 2.0 * torch.stack([(pattern >> j) & 1 for j in range(8)], dim=1).to(torch.float32)


_GRIDS: dict[GGMLQuantizationType, torch.Tensor] = {}
_SIGNS = _sign_table()
_IQ1_DELTA = 0.125  # IQ1S_DELTA / IQ1M_DELTA


def grid(ggml_type: GGMLQuantizationType) -> torch.Tensor:
    """The decoded grid of an IQ type (decoded once, on first use)."""
    if ggml_type not in _GRIDS:
        _GRIDS[ggml_type] = _grid(getattr(quants, ggml_type.name))
    return _GRIDS[ggml_type]


def _points(ggml_type: GGMLQuantizationType, index: torch.Tensor) -> torch.Tensor:
    """Grid points for integer indices `[...]` -> `[..., values per point]`."""
    table = on(grid(ggml_type), index.device)
    return table.index_select(0, index.reshape(-1).long()).view(*index.shape, table.shape[1])


def _signs(index: torch.Tensor) -> torch.Tensor:
    """Sign patterns for 7-bit indices `[...]` -> `[..., 8]` of +1 / -1."""
    return on(_SIGNS, index.device).index_select(0, index.reshape(-1).long()).view(*index.shape, 8)


_BYTE_BITS = torch.stack([(torch.arange(256) >> j) & 1 for j in range(8)], dim=1).to(torch.int32)  # [256, 8]
_BYTE_SIGNS = 1.0 - 2.0 * _BYTE_BITS.to(torch.float32)  # [256, 8]: bit j set -> -1


def _bits(field: torch.Tensor) -> torch.Tensor:
    """`[N, B]` bytes -> `[N, B, 8]` int32: bit j of each byte (least significant first), by table."""
    return on(_BYTE_BITS, field.device).index_select(0, field.reshape(-1).long()).view(*field.shape, 8)


def _byte_signs(field: torch.Tensor) -> torch.Tensor:
    """`[N, B]` sign bytes -> `[N, B, 8]` float32: -1 where bit j is set (a minus), else +1, by table."""
    return on(_BYTE_SIGNS, field.device).index_select(0, field.reshape(-1).long()).view(*field.shape, 8)


def _half_scales(d: torch.Tensor, scales: torch.Tensor, unit: float) -> torch.Tensor:
    """IQ2 / IQ3_XXS steps `d * (0.5 + s) * unit` (4-bit s; unit 0.25 or 0.5) as float32."""
    return d * (0.5 + scales.to(torch.float32)) * unit


def _nibble_pairs(field: torch.Tensor) -> torch.Tensor:
    """`[N, B]` bytes -> `[N, 2B]` int32: low nibble, then high nibble, of each byte."""
    b = field.to(torch.int32)
    return torch.stack([b & 0x0F, b >> 4], dim=-1).reshape(field.shape[0], -1)


def _iq2_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq2_xxs: d f16 | 8 x (u32 four grid indices (a byte each), u32 four 7-bit sign indices | 4-bit scale << 28)
    # 8 groups of 32 values, each 4 points of 8: value = (d * (0.5 + s) * 0.25) * grid * sign
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)  # [N, 1]
    aux = u32_fields(blocks, 2, 16).view(n, 8, 2)  # [N, 8, (indices, signs+scale)]
    db = _half_scales(d, (aux[..., 1] >> 28) & 0xF, 0.25)  # [N, 8]
    idx = aligned(aux[..., :1], 4).view(torch.uint8).view(n, 8, 4)  # the 4 index bytes of each group
    sgn = torch.stack([(aux[..., 1] >> (7 * k)) & 0x7F for k in range(4)], dim=-1)  # [N, 8, 4]
    view = out.view(n, 8, 4, 8)
    torch.mul(_points(T.IQ2_XXS, idx), _signs(sgn), out=view)
    view.mul_(db.view(n, 8, 1, 1))


def _iq2_xs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq2_xs: d f16 | qs u16[32] (9-bit grid index | 7-bit sign index << 9) | scales[8] (two 4-bit each)
    # 16 groups of 16 values (2 points of 8), one scale each: value = (d * (0.5 + s) * 0.25) * grid * sign
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)
    qs = u16_fields(blocks, 2, 32).view(n, 16, 2)
    db = _half_scales(d, _nibble_pairs(blocks[:, 66:74]), 0.25)  # [N, 16]
    view = out.view(n, 16, 2, 8)
    torch.mul(_points(T.IQ2_XS, qs & 511), _signs(qs >> 9), out=view)
    view.mul_(db.view(n, 16, 1, 1))


def _iq2_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq2_s: d f16 | qs[32] (low 8 index bits) | signs[32] (a bit per value) | qh[8] (2 high index bits
    # per point) | scales[8]; 16 groups of 16 values as IQ2_XS, the signs stored plainly
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)
    high = bit_fields(blocks[:, 66:74].reshape(n, 1, 8), (0, 2, 4, 6), 0x03)  # [N, 1, 4, 8]: point 4j+k in qh[j] >> 2k
    idx = blocks[:, 2:34].to(torch.int32) | (high.reshape(n, 4, 8).transpose(1, 2).reshape(n, 32).to(torch.int32) << 8)
    db = _half_scales(d, _nibble_pairs(blocks[:, 74:82]), 0.25)  # [N, 16]
    view = out.view(n, 16, 2, 8)
    torch.mul(_points(T.IQ2_S, idx).view(n, 16, 2, 8), _byte_signs(blocks[:, 34:66]).view(n, 16, 2, 8), out=view)
    view.mul_(db.view(n, 16, 1, 1))


def _iq3_xxs(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq3_xxs: d f16 | qs[64] (a grid index per 4 values) | u32[8] (four 7-bit sign indices | 4-bit scale << 28)
    # 8 groups of 32 values: value = (d * (0.5 + s) * 0.5) * grid * sign
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)
    ss = u32_fields(blocks, 66, 8)  # [N, 8]
    db = _half_scales(d, (ss >> 28) & 0xF, 0.5)
    sgn = torch.stack([(ss >> (7 * k)) & 0x7F for k in range(4)], dim=-1)  # [N, 8, 4]
    view = out.view(n, 8, 4, 8)
    torch.mul(_points(T.IQ3_XXS, blocks[:, 2:66]).view(n, 8, 4, 8), _signs(sgn), out=view)
    view.mul_(db.view(n, 8, 1, 1))


def _iq3_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq3_s: d f16 | qs[64] (low 8 index bits) | qh[8] (the ninth bit of each index) | signs[32] | scales[4]
    # 8 groups of 32 values: value = (d * (1 + 2 s)) * grid * sign
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)
    idx = blocks[:, 2:66].to(torch.int32) | (_bits(blocks[:, 66:74]).reshape(n, 64) << 8)
    db = d * (1 + 2 * _nibble_pairs(blocks[:, 106:110])).to(torch.float32)  # [N, 8]
    view = out.view(n, 8, 32)
    torch.mul(_points(T.IQ3_S, idx).view(n, 8, 32), _byte_signs(blocks[:, 74:106]).view(n, 8, 32), out=view)
    view.mul_(db.unsqueeze(-1))


def _iq1_s(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq1_s: d f16 | qs[32] (low 8 index bits) | qh u16[8]: per group of 32, bits 0-11 the 3 high index
    # bits of its 4 points, 12-14 the scale s, 15 the delta's sign; value = (d * (2 s + 1)) * (grid + delta)
    n = blocks.shape[0]
    d = f16_fields(blocks, 0)
    qh = u16_fields(blocks, 34, 8)  # [N, 8]
    dl = d * (2 * ((qh >> 12) & 7) + 1).to(torch.float32)
    delta = torch.where((qh & 0x8000) == 0, _IQ1_DELTA, -_IQ1_DELTA)  # [N, 8]
    high = torch.stack([(qh >> (3 * k)) & 7 for k in range(4)], dim=-1).reshape(n, 32)
    view = out.view(n, 8, 4, 8)
    torch.add(_points(T.IQ1_S, blocks[:, 2:34].to(torch.int32) | (high << 8)).view(n, 8, 4, 8),
              delta.view(n, 8, 1, 1), out=view)
    view.mul_(dl.view(n, 8, 1, 1))


def _iq1_m(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_iq1_m: qs[32] (low 8 index bits) | qh[16] (per point: 3 high index bits, delta sign bit 3) |
    # scales u16[4]: 3-bit scales (four per word), the f16 d in the top 4 bits of the words (d's bits 0-3 in word 0)
    # 8 groups of 32 values: scale per 16 values, delta per 8; value = (d * (2 s + 1)) * (grid + delta)
    n = blocks.shape[0]
    sc = u16_fields(blocks, 48, 4)  # [N, 4]
    d_bits = (sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000)
    d = d_bits.to(torch.int16).view(torch.float16).to(torch.float32).unsqueeze(-1)  # [N, 1]
    s = torch.stack([(sc >> (3 * k)) & 7 for k in range(4)], dim=-1).reshape(n, 16)
    dl = d * (2 * s + 1).to(torch.float32)  # [N, 16]
    qh = _nibble_pairs(blocks[:, 32:48])  # [N, 32]: point 2j in the low nibble of qh[j], 2j+1 in the high one
    delta = torch.where((qh & 0x08) == 0, _IQ1_DELTA, -_IQ1_DELTA)
    view = out.view(n, 32, 8)
    torch.add(_points(T.IQ1_M, blocks[:, :32].to(torch.int32) | ((qh & 7) << 8)), delta.unsqueeze(-1), out=view)
    out.view(n, 16, 16).mul_(dl.unsqueeze(-1))


_POW3 = torch.tensor([1, 3, 9, 27, 81], dtype=torch.uint8)


def _tq1_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_tq1_0: qs[48] | qh[4] | d f16; five (qs) or four (qh) base-3 digits per byte, read as the top
    # digit of byte * 3^k (mod 256) scaled to 0..2: value = d * (((b * 3^k mod 256) * 3 >> 8) - 1)
    n = blocks.shape[0]
    d = f16_fields(blocks, 52)
    pow3 = on(_POW3, blocks.device)
    parts = [blocks[:, a:b].unsqueeze(1) * pow3[:k].view(1, k, 1)  # uint8 products wrap mod 256, as in ggml
             for a, b, k in ((0, 32, 5), (32, 48, 5), (48, 52, 4))]  # [N, k, bytes]
    q = torch.cat([p.reshape(n, -1) for p in parts], dim=1).to(torch.int16)  # [N, 256]
    out.copy_((q * 3) >> 8)
    out.sub_(1.0).mul_(d)


def _tq2_0(blocks: torch.Tensor, out: torch.Tensor) -> None:
    # block_tq2_0: qs[64] (four 2-bit values per byte, 32 bytes per 128 values) | d f16; value = d * (q - 1)
    n = blocks.shape[0]
    out.copy_(bit_fields(blocks[:, :64].reshape(n, 2, 32), (0, 2, 4, 6), 0x03).reshape(n, 256))
    out.sub_(1.0).mul_(f16_fields(blocks, 64))


IQ_DECODERS = {
    T.IQ1_S: _iq1_s,
    T.IQ1_M: _iq1_m,
    T.IQ2_XXS: _iq2_xxs,
    T.IQ2_XS: _iq2_xs,
    T.IQ2_S: _iq2_s,
    T.IQ3_XXS: _iq3_xxs,
    T.IQ3_S: _iq3_s,
    T.TQ1_0: _tq1_0,
    T.TQ2_0: _tq2_0,
}
