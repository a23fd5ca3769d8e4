"""GGUF blocks repacked at load for the row kernels: Q4_1_R8 (`Q4_1 | 0x100`, kernels/ggml_gemv/ggml_rows.h Rows8R8),
Q4_K_R8 (`Q4_K | 0x100`, ggml_rows8_k.h) and Q6_K_R8 (`Q6_K | 0x100`, ggml_rows8_q6k.h).

A Q4_1 matrix of a multiple of eight rows is rewritten, eight rows at a time, per block of 32 values: the eight rows'
(d, m) halves, then their nibbles transposed so that one 32-byte load holds four bytes of each row (what the eight-
and sixteen-row kernels made of the GGUF bytes with a gather and a transposition per block and call).

A Q4_K matrix of a multiple of eight rows is rewritten, eight rows at a time, into what the eight-row kernels made of
its bytes at run time (the eight rows' d, dmin and scale bytes, then their nibbles, transposed so that one 32-byte load
holds four bytes of each row); a Q6_K one into eight rows' d and int8 scales transposed, then per 16 values three
32-byte vectors of four bytes per row holding four values' 6-bit codes each and, in their top two bits, the codes of
four more. Either way the same bytes per eight rows in the same place (a slice of whole groups of eight rows
stays a slice), the same values, and the same bits out of every kernel path as the GGUF layout. The
store, the pager and a converted store keep the GGUF layout; the loader repacks the matrices it keeps resident
(engine/quantized.py `repack_blocks`).

A Q8_0 matrix read by the x16 rows (a dense model's lm_head on int16-rounded inputs) of a multiple of sixteen rows
is rewritten sixteen rows at a time into Q8_0_R16 (`Q8_0 | 0x100`, ggml_rows.h Rows16X16): per group its blocks' codes
as 64-byte vectors of four bytes per row, then their fp16 steps; only those rows read it (`X16_REPACKED`), the int8
and fp32-x rows keep the GGUF layout.

`REPACKED[t]` is the repacked type of GGML type t, `plain_type(t)` the type a repacked one came from (itself for the
others); `repack(raw, t, rows)` (in place where `out` is raw) and `unpack(raw, t, rows)` run ggml_cpu.cpp
`ggml_repack`. A reader of the GGUF layout (a dequantiser, a reference) takes `unpack`'s bytes and `plain_type`.
"""

from __future__ import annotations

import torch
from gguf import GGMLQuantizationType

from localmoe.kernels._cpu import library

Q = GGMLQuantizationType
REPACK_FLAG = 0x100  # ggml_rows.h kRepacked


class RepackedType(int):
    """A GGML type's repacked form: the int the kernels take (type | REPACK_FLAG), `.plain` the GGML type, `.rows` the
    rows repacked together, `.name`."""

    plain: GGMLQuantizationType
    rows: int

    def __new__(cls, plain: GGMLQuantizationType, rows: int = 8) -> RepackedType:
        self = super().__new__(cls, int(plain) | REPACK_FLAG)
        self.plain, self.rows = plain, rows
        return self

    @property
    def name(self) -> str:
        return f"{self.plain.name}_R{self.rows}"

    def __repr__(self) -> str:
        return self.name


Q4_1_R8 = RepackedType(Q.Q4_1)
Q4_K_R8 = RepackedType(Q.Q4_K)
Q6_K_R8 = RepackedType(Q.Q6_K)
Q8_0_R16 = RepackedType(Q.Q8_0, 16)
REPACKED = {Q.Q4_1: Q4_1_R8, Q.Q4_K: Q4_K_R8, Q.Q6_K: Q6_K_R8}
X16_REPACKED = {Q.Q8_0: Q8_0_R16}  # for the x16 rows only
UNITS = {Q.Q4_1: (20, 32), Q.Q4_K: (144, 256), Q.Q6_K: (210, 256), Q.Q8_0: (34, 32)}  # (bytes, values) of a block / super-block


def plain_type(ggml_type):
    """The GGML type whose blocks a (repacked or plain) type holds."""
    return ggml_type.plain if isinstance(ggml_type, RepackedType) else ggml_type


def can_repack(ggml_type, rows: int, cols: int, x16: bool = False) -> bool:
    """Whether a [rows, cols] matrix of `ggml_type` has a repacked form here (the CPU library, whole groups); x16: the
    form the x16 rows read (X16_REPACKED)."""
    kind = (X16_REPACKED if x16 else REPACKED).get(ggml_type)
    return (kind is not None and rows % kind.rows == 0 and cols % UNITS[ggml_type][1] == 0
            and library() is not None)


def _run(raw: torch.Tensor, ggml_type, rows: int, out: torch.Tensor, pack: bool) -> torch.Tensor:
    lib = library()
    if lib is None or not raw.is_contiguous() or raw.dtype != torch.uint8 or raw.device.type != "cpu":
        raise ValueError("repacking takes contiguous uint8 blocks on the CPU with the kernel library")
    row_bytes = raw.numel() // rows
    unit_bytes, unit_values = UNITS.get(plain_type(ggml_type), (row_bytes + 1, 0))
    cols = row_bytes // unit_bytes * unit_values
    form = {**REPACKED, **X16_REPACKED}.get(plain_type(ggml_type), Q4_1_R8)  # (a type without one: the call says so)
    tmp = torch.empty(form.rows * row_bytes, dtype=torch.uint8)  # one group of rows
    if lib.ggml_repack(raw.data_ptr(), out.data_ptr(), rows, cols, int(plain_type(ggml_type)), int(pack),
                       tmp.data_ptr()):
        raise ValueError(f"{plain_type(ggml_type).name} [{rows}, {cols}] has no repacked form")
    return out


def repack(raw: torch.Tensor, ggml_type, rows: int, out: torch.Tensor | None = None,
           x16: bool = False) -> tuple[torch.Tensor, RepackedType]:
    """The repacked bytes (into `out`, a new tensor by default; raw itself repacks in place) and their type; x16: the
    x16 rows' form (X16_REPACKED)."""
    out = torch.empty_like(raw, memory_format=torch.contiguous_format) if out is None else out
    return _run(raw, ggml_type, rows, out, True), (X16_REPACKED if x16 else REPACKED)[ggml_type]


def unpack(raw: torch.Tensor, ggml_type, rows: int) -> torch.Tensor:
    """The GGUF layout of repacked bytes (a new tensor); plain bytes as they are."""
    if not isinstance(ggml_type, RepackedType):
        return raw
    return _run(raw.contiguous(), ggml_type, rows, torch.empty_like(raw, memory_format=torch.contiguous_format), False)


__all__ = ["Q4_1_R8", "Q4_K_R8", "Q6_K_R8", "Q8_0_R16", "REPACKED", "REPACK_FLAG", "RepackedType",
           "X16_REPACKED", "can_repack", "plain_type", "repack", "unpack"]
