"""MXFP4 (OCP Microscaling v1.0): quantise, dequantise and lossless repacks, in torch.

A block is 32 E2M1 elements sharing one E8M0 scale byte `s` (bias 127, 0xFF = NaN):
value = e2m1(code) * 2^(s - 127), e2m1 codes {0, .5, 1, 1.5, 2, 3, 4, 6} with bit 3 the sign.

The canonical layout (= K3 compressed-tensors) is `packed: [..., K/2]` uint8 with element
2i in the low nibble of byte i and `scales: [..., K/32]` uint8. The other layouts in the
wild (gpt-oss `*_blocks`/`*_scales`, ggml `block_mxfp4`) hold the same codes and the same
scale bytes, so converting between them only moves nibbles: see docs/mxfp4.md.

Everything is vectorised torch on the tensors' own device; large tensors are processed in
chunks of blocks so the temporaries stay bounded. There is no Python loop over blocks.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from localmoe.errors import CheckpointError

BLOCK = 32  # elements per MX block (OCP v1.0)
SCALE_BIAS = 127  # E8M0: scale = 2^(byte - 127)
SCALE_NAN = 0xFF  # E8M0 NaN: the whole block decodes to NaN
GGML_BLOCK_BYTES = 17  # ggml block_mxfp4: 1 scale byte + 16 code bytes
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# Scale rules: s = the smallest exponent with amax <= limit * 2^s (amax < 8 * 2^s for "ocp").
# "midpoint" is the default: measured lowest error, see docs/mxfp4.md.
SCALE_RULES = {
    "ocp": 8.0,  # OCP v1.0 6.3: floor(log2 amax) - 2; elements above 6 * 2^s saturate
    "no_clip": 6.0,  # ceil(log2(amax / 6)); nothing saturates (NVIDIA's "RCEIL")
    "midpoint": 7.0,  # saturate only up to 7 * 2^s, midway between 6 and the next binade's 8
}
DEFAULT_SCALE_RULE = "midpoint"

# Round-to-nearest-even onto the E2M1 magnitudes: code c (1..7) wins over c-1 above tie
# c-1. Exact ties go to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, 1.75 -> 2,
# 2.5 -> 2, 3.5 -> 4, 5 -> 4 (so 0.75, 1.75 and 3.5 themselves round up). Above 5 -> 6.
_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_TIE_GOES_UP = (False, True, False, True, False, True, False)

# Float layouts the quantiser works in: (int view, mantissa bits, exponent bias, all-ones exponent)
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127, 0xFF), torch.float64: (torch.int64, 52, 1023, 0x7FF)}

_CHUNK_BLOCKS = 1 << 13  # blocks per chunk (256 Ki values, 1 MiB of float32 per temporary)
_DEQUANT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_tables: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}


def _e2m1_code(y: torch.Tensor) -> torch.Tensor:
    """Reference rounding of float64 `y` to E2M1 codes (sign in bit 3, saturating at 6)."""
    mag = y.abs()
    code = torch.zeros(y.shape, dtype=torch.uint8)
    for tie, up in zip(_TIES, _TIE_GOES_UP):
        code += (mag >= tie) if up else (mag > tie)
    return code | (torch.signbit(y).to(torch.uint8) << 3)


def _build(name: str, dtype: torch.dtype) -> torch.Tensor:
    """The constant tables, on the CPU; every entry is exact (built in float64)."""
    e2m1 = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    pair = torch.stack((e2m1.repeat(16), e2m1.repeat_interleave(16)), dim=-1)  # [256, 2]: byte b -> (lo, hi)
    scale = torch.tensor([2.0 ** (b - SCALE_BIAS) for b in range(255)] + [float("nan")], dtype=torch.float64)
    if name == "pair":  # [256, 2]
        return pair.to(dtype)
    if name == "scale":  # [256]: 2^(byte - 127); 0xFF -> NaN
        return scale.to(dtype)
    if name == "inv_scale":  # [256]: 2^(127 - byte); 0 for 0xFF, whose codes are zeroed anyway
        return torch.cat((1.0 / scale[:255], torch.zeros(1, dtype=torch.float64))).to(dtype)
    if name == "decode":  # [65536]: (scale byte << 8 | code byte) -> both values, bit-packed
        values = (scale.view(256, 1, 1) * pair).to(torch.float32)  # [256, 256, 2], float32 as specified
        return values.to(dtype).view(torch.int64 if dtype == torch.float32 else torch.int32).reshape(-1)
    if name == "encode":  # code of y from its bits: (sign | exponent | 2 mantissa bits) << 1 | sticky
        ints, mant, _, _ = _FLOAT_BITS[dtype]
        width = 64 if dtype == torch.float64 else 32
        idx = torch.arange(1 << (width - mant + 3), dtype=torch.int64)
        # a representative of each class: the top bits, plus the lowest bit when sticky
        bits = ((idx >> 1) << (mant - 2)) | (idx & 1)
        if ints == torch.int32:
            bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits)  # as a signed int32
        return _e2m1_code(bits.to(ints).view(dtype).to(torch.float64))
    raise KeyError(name)


def _table(name: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    key = (name, dtype, device)
    if key not in _tables:
        _tables[key] = _build(name, dtype).to(device)
    return _tables[key]


def _check_canonical(packed: torch.Tensor, scales: torch.Tensor) -> None:
    if packed.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise CheckpointError(f"MXFP4 codes and scales must be uint8, got {packed.dtype} and {scales.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] != scales.shape[-1] * (BLOCK // 2):
        raise CheckpointError(f"MXFP4 codes of shape {tuple(packed.shape)} do not match scales of shape "
                              f"{tuple(scales.shape)}: expected codes [..., K/2] with scales [..., K/32]")


def _block_chunks(x: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    """(first block index, `[n, 32]` blocks) chunks of `x: [..., K]`, copying at most a chunk."""
    k = x.shape[-1]
    if x.is_contiguous():
        blocks = x.view(-1, BLOCK)
        for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
            yield start, blocks[start:start + _CHUNK_BLOCKS]
        return
    rows = x if x.dim() == 2 else x.reshape(-1, k)  # a 2-D strided view is sliced by rows, uncopied
    step = max(1, _CHUNK_BLOCKS * BLOCK // k)
    for r in range(0, rows.shape[0], step):
        yield r * (k // BLOCK), rows[r:r + step].reshape(-1, BLOCK)


def _scale_bytes(amax: torch.Tensor, limit: float) -> torch.Tensor:
    """E8M0 scale byte per block from its `amax: [n]` (float32/64, >= 0 or NaN): the smallest
    s with amax <= limit * 2^s, clamped below at 2^-127; NaN, Inf or a scale above 2^127 -> 0xFF."""
    ints, mant, bias, inf_exp = _FLOAT_BITS[amax.dtype]
    bits = amax.view(ints)
    exp = bits >> mant  # biased; 0 for zero and subnormals, which all clamp to byte 0
    # amax = 1.m * 2^e: 2^(e-2) gives amax / 2^s in [4, 8); one more when 1.m > limit / 4
    bump = (bits & ((1 << mant) - 1)) > int((limit / 4 - 1) * (1 << mant))
    s = (exp - (bias - SCALE_BIAS) - 2 + bump).clamp_(min=0)
    bad = (exp == inf_exp) | (s > 254)
    return torch.where(bad, SCALE_NAN, s).to(torch.uint8)


def _quantize_blocks(blocks: torch.Tensor, work: torch.dtype, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`[n, 32]` float blocks -> (codes packed `[n, 16]` uint8, scale bytes `[n]` uint8)."""
    amax = torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg()).to(work)  # NaN propagates
    scales = _scale_bytes(amax, limit)
    inv = _table("inv_scale", work, blocks.device).index_select(0, scales.int())
    y = torch.mul(blocks, inv.unsqueeze(-1))  # exact: a power of two (subnormal only far below 0.25)
    ints, mant, _, _ = _FLOAT_BITS[work]
    width = 64 if work == torch.float64 else 32
    bits = y.view(ints)
    # encode index: (sign | exponent | top 2 mantissa bits) << 1 | sticky (any lower bit set);
    # every rounding boundary of the E2M1 grid is such a class edge, so the class fixes the code
    idx = (bits >> (mant - 3)).bitwise_and_((1 << (width - mant + 3)) - 2)
    idx.add_((bits & ((1 << (mant - 2)) - 1)) != 0)
    code = _table("encode", work, blocks.device).index_select(0, idx.view(-1).int())
    pairs = code.view(torch.int16)  # element 2i | element 2i+1 << 8 (a little-endian host, as ggml assumes)
    packed = (pairs | (pairs >> 4)).bitwise_and_(0xFF).to(torch.uint8).view(-1, BLOCK // 2)
    packed.masked_fill_((scales == SCALE_NAN).unsqueeze(-1), 0)  # NaN blocks store zero codes
    return packed, scales


def quantize(x: torch.Tensor, scale_rule: str = DEFAULT_SCALE_RULE) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise `x: [..., K]` (float, K % 32 == 0) to MXFP4, canonical layout.

    Returns (packed `[..., K/2]` uint8, element 2i in the low nibble of byte i;
    scales `[..., K/32]` uint8 E8M0), on x's device. Elements round to nearest, ties to
    even, on the E2M1 grid; each block's scale follows `scale_rule` (default "midpoint":
    the smallest s with amax <= 7 * 2^s, so the per-element error is at most
    max(|x| / 5, amax / 14, 2^-129); see docs/mxfp4.md for the measured comparison).
    Zero blocks get scale byte 0; a block scale below 2^-127 clamps there (tiny values
    flush to zero); a block holding NaN or +-Inf, or needing a scale above 2^127, gets
    scale 0xFF (NaN) and zero codes. Signs are kept, so -0.0 encodes as code 8.
    float64 input is quantised in float64; other float dtypes (float8 too) in float32, exactly.
    """
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown MXFP4 scale rule {scale_rule!r}; choose one of {sorted(SCALE_RULES)}")
    if not x.is_floating_point() or x.dim() == 0 or x.shape[-1] % BLOCK:
        raise CheckpointError(f"cannot quantise a {x.dtype} tensor of shape {tuple(x.shape)} to MXFP4: "
                              f"it needs a float tensor whose last dimension is a multiple of {BLOCK}")
    work = torch.float64 if x.dtype == torch.float64 else torch.float32
    lead, k = x.shape[:-1], x.shape[-1]
    n_blocks = x.numel() // BLOCK
    packed = torch.empty(n_blocks, BLOCK // 2, dtype=torch.uint8, device=x.device)
    scales = torch.empty(n_blocks, dtype=torch.uint8, device=x.device)
    for start, blocks in _block_chunks(x):
        blocks = blocks.to(work)  # exact for every narrower float (bf16, f16, float8)
        p, s = _quantize_blocks(blocks, work, SCALE_RULES[scale_rule])
        packed[start:start + len(s)] = p
        scales[start:start + len(s)] = s
    return packed.view(*lead, k // 2), scales.view(*lead, k // BLOCK)


def dequantize(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Canonical MXFP4 (`packed: [..., K/2]`, `scales: [..., K/32]`, uint8) -> `[..., K]` of `dtype`.

    dtype: float32, bfloat16, float16 or float64, on packed's device. Values are computed
    exactly in float32 (float64 for float64) and then cast, so bf16 == f32.to(bf16).
    Exact in float32 and bfloat16 for scale bytes 0..252 (253 and 254 overflow the large
    codes to +-Inf), in float16 for bytes 104..140 only, in float64 always. Scale 0xFF gives
    NaN for the whole block; code 8 gives -0.0.
    """
    _check_canonical(packed, scales)
    if dtype not in _DEQUANT_DTYPES:
        raise ValueError(f"MXFP4 dequantises to one of {_DEQUANT_DTYPES}, not {dtype}")
    lead, k = packed.shape[:-1], packed.shape[-1] * 2
    n_blocks = scales.numel()
    p, s = packed.reshape(n_blocks, BLOCK // 2), scales.reshape(n_blocks, 1)
    out = torch.empty(n_blocks, BLOCK, dtype=dtype, device=packed.device)
    if dtype == torch.float64:
        pair, scale = _table("pair", dtype, packed.device), _table("scale", dtype, packed.device)
    else:  # one gather per byte: (scale << 8 | byte) -> its two values, as one 64/32-bit word
        table = _table("decode", dtype, packed.device)
        words = out.view(table.dtype)  # [n, 16]
    for start in range(0, n_blocks, _CHUNK_BLOCKS):
        end = min(start + _CHUNK_BLOCKS, n_blocks)
        if dtype == torch.float64:
            values = pair[p[start:end].long()].view(end - start, BLOCK)  # [n, 16, 2] -> [n, 32]
            torch.mul(values, scale[s[start:end].long()], out=out[start:end])
        else:
            idx = torch.add(p[start:end], s[start:end].int(), alpha=256)  # int32 [n, 16]
            torch.index_select(table, 0, idx.view(-1), out=words[start:end].view(-1))
    return out.view(*lead, k)


def quantization_error(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> dict[str, float]:
    """Error of the canonical MXFP4 tensor (packed, scales) against the original `x: [..., K]`.

    Returns {"rmse", "max_abs", "relative_rmse" (= rmse / rms(x), 0 when both are 0)},
    computed in float64 chunk by chunk, for conversion logs.
    """
    _check_canonical(packed, scales)
    if x.shape[:-1] != packed.shape[:-1] or x.shape[-1] != packed.shape[-1] * 2:
        raise CheckpointError(f"tensor of shape {tuple(x.shape)} does not match MXFP4 codes of shape "
                              f"{tuple(packed.shape)}")
    p, s = packed.reshape(-1, BLOCK // 2), scales.reshape(-1, 1)
    sq_err = sq_x = max_abs = torch.zeros((), dtype=torch.float64, device=x.device)
    for start, blocks in _block_chunks(x):
        end = start + blocks.shape[0]
        err = dequantize(p[start:end], s[start:end], torch.float64) - blocks.to(torch.float64)
        sq_err = sq_err + err.square().sum()
        sq_x = sq_x + blocks.to(torch.float64).square().sum()
        max_abs = torch.maximum(max_abs, err.abs().max())
    n = max(x.numel(), 1)
    rmse, rms = (sq_err / n).sqrt().item(), (sq_x / n).sqrt().item()
    relative = rmse / rms if rms > 0 else (0.0 if rmse == 0 else float("inf"))
    return {"rmse": rmse, "max_abs": max_abs.item(), "relative_rmse": relative}


# ---- lossless repacks: the same codes and scale bytes, only the nibbles move ----

def gpt_oss_to_canonical(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss `*_blocks: [..., R, K/32, 16]`, `*_scales: [..., R, K/32]` -> canonical
    (packed `[..., R, K/2]`, scales `[..., R, K/32]`). Same nibble order: a reshape (a view
    where possible)."""
    if blocks.dim() < 2 or blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise CheckpointError(f"gpt-oss MXFP4 blocks of shape {tuple(blocks.shape)} do not match scales of "
                              f"shape {tuple(scales.shape)}: expected blocks [..., K/32, 16], scales [..., K/32]")
    packed = blocks.reshape(*blocks.shape[:-2], -1)
    _check_canonical(packed, scales)
    return packed, scales


def canonical_to_gpt_oss(packed: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Canonical (packed `[..., K/2]`, scales `[..., K/32]`) -> gpt-oss (blocks
    `[..., K/32, 16]`, scales `[..., K/32]`). A reshape (a view where possible)."""
    _check_canonical(packed, scales)
    return packed.reshape(*scales.shape, BLOCK // 2), scales


def _row_dim(scales: torch.Tensor) -> int:
    if scales.dim() < 2:
        raise CheckpointError(f"MXFP4 scales of shape {tuple(scales.shape)} have no row dimension")
    return scales.dim() - 2  # the same index in scales and in canonical or gpt-oss codes


def split_gate_up_interleaved(packed: torch.Tensor, scales: torch.Tensor
                              ) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """gpt-oss `gate_up_proj` rows interleave gate (even rows) and up (odd rows).

    packed: canonical `[..., 2I, K/2]` or gpt-oss `[..., 2I, K/32, 16]`; scales `[..., 2I, K/32]`.
    Returns ((gate packed, gate scales), (up packed, up scales)), each with I rows, in the
    input's layout, contiguous.
    """
    d = _row_dim(scales)
    if packed.shape[d] != scales.shape[d] or scales.shape[d] % 2:
        raise CheckpointError(f"gate_up MXFP4 tensors of shapes {tuple(packed.shape)} and {tuple(scales.shape)} "
                              f"need the same, even number of rows in dimension {d}")

    def rows(t: torch.Tensor, first: int) -> torch.Tensor:
        return t.narrow(d, first, t.shape[d] - first)[(slice(None),) * d + (slice(None, None, 2),)].contiguous()

    return (rows(packed, 0), rows(scales, 0)), (rows(packed, 1), rows(scales, 1))


def interleave_gate_up(gate: tuple[torch.Tensor, torch.Tensor], up: tuple[torch.Tensor, torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of `split_gate_up_interleaved`: (packed, scales) pairs of I rows each ->
    (packed, scales) of 2I rows, gate on the even rows, up on the odd ones."""
    if gate[0].shape != up[0].shape or gate[1].shape != up[1].shape:
        raise CheckpointError(f"gate {tuple(gate[0].shape)}/{tuple(gate[1].shape)} and up "
                              f"{tuple(up[0].shape)}/{tuple(up[1].shape)} MXFP4 shapes differ")
    d = _row_dim(gate[1])
    return tuple(torch.stack((g, u), dim=d + 1).flatten(d, d + 1) for g, u in zip(gate, up))  # type: ignore[return-value]


def canonical_to_ggml(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Canonical (packed `[..., K/2]`, scales `[..., K/32]`) -> ggml `block_mxfp4` bytes
    `[..., K/32, 17]`: the scale byte, then byte j = element j | element j+16 << 4."""
    _check_canonical(packed, scales)
    p = packed.reshape(-1, BLOCK // 2)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).view(-1, BLOCK)  # [N, 32] in element order
    qs = codes[:, :16] | (codes[:, 16:] << 4)
    return torch.cat((scales.reshape(-1, 1), qs), dim=-1).view(*scales.shape, GGML_BLOCK_BYTES)


def ggml_to_canonical(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml `block_mxfp4` bytes `[..., K/32, 17]` -> canonical (packed `[..., K/2]`,
    scales `[..., K/32]`). A raw row of K/32 * 17 bytes can be passed as `.view(..., -1, 17)`."""
    if blocks.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != GGML_BLOCK_BYTES:
        raise CheckpointError(f"ggml MXFP4 blocks must be uint8 [..., K/32, {GGML_BLOCK_BYTES}], "
                              f"got {blocks.dtype} {tuple(blocks.shape)}")
    b = blocks.reshape(-1, GGML_BLOCK_BYTES)
    qs = b[:, 1:]
    codes = torch.cat((qs & 0xF, qs >> 4), dim=-1)  # [N, 32] in element order
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.reshape(*blocks.shape[:-2], -1), b[:, 0].contiguous().reshape(blocks.shape[:-1])
