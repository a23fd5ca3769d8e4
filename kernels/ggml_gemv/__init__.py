"""GEMV from GGUF block formats (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS; Q4_1_R8 / Q4_K_R8 /
Q6_K_R8: Q4_1 / Q4_K / Q6_K repacked at load, repacked.py; Q8_0_R16: a Q8_0 x16 head repacked at load) for decode: y = x W^T (+ b) with x rounded to
int8 per 32 values (IQ4_XS too), per 256 for the K-quants (`x_block`: llama.cpp's Q8_0 / Q8_K trade), W read in the file's own blocks. `exact_x` (EXACT_X_TYPES)
keeps x in fp32, for a matrix whose output must not see that rounding (the lm_head); `x16` (X16_TYPES: Q8_0) rounds x to
int16 per 32 values instead (2^-16 of a block's largest value where int8 keeps 2^-8), read with integer dot
products at about twice the int8 row's cost where fp32 x costs ~6x (a dense model's Q8_0 lm_head by default).

Many tokens at once (a batched decode step's N rows) decode each weight block once for a tile of
tokens (8 with AVX-512 VNNI, 4 on AVX2; Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0: 16 / 4, eight weight rows per vector) instead of
once per token, and a token's result has the same
bits whatever N is (ggml_rows.h). MAX_ROWS: the most rows the engine hands one call (a decode batch;
prefill chunks above it run an fp32 GEMM on the dequantised weight, engine/quantized.py).

- CPU with the library (kernels/_cpu; ggml_cpu.cpp): fp32 x [N, K] contiguous, raw blocks contiguous.
- otherwise the reference (reference.py: dequantise, round x, matmul).
"""

from __future__ import annotations

import ctypes

import torch
from gguf import GGMLQuantizationType
from localmoe.kernels._cpu import library, threads
from localmoe.kernels.ggml_gemv.reference import K_QUANTS, naive_ggml_gemv, q16_round, row_values, x_block
from localmoe.kernels.ggml_gemv.repacked import Q4_1_R8, Q4_K_R8, Q6_K_R8, Q8_0_R16

Q = GGMLQuantizationType
TYPES = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K,  # the file's types the kernels read
         Q.IQ4_NL, Q.IQ4_XS)  # (IQ4: ggml_rows_iq4.h)
KERNEL_TYPES = (*TYPES, Q4_1_R8, Q4_K_R8, Q6_K_R8)  # and the repacked ones (repacked.py: repacked at load)
EXACT_X_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q6_K)  # with a row against fp32 x (the lm_head's types in GGUF files)
X16_TYPES = (Q.Q8_0, Q8_0_R16)  # with a row against x rounded to int16 per 32 (Q8_0_R16: repacked.py, x16 only)
MAX_ROWS = 64  # decode batches up to here run the kernel, a row independent of the others (see the module doc)


def kernel_available() -> bool:
    return library() is not None


def ggml_gemv(x: torch.Tensor, raw: torch.Tensor, ggml_type, shape: tuple[int, int],
              bias: torch.Tensor | None = None, exact_x: bool = False, x16: bool = False) -> torch.Tensor:
    """x [N, K] fp32, raw blocks [O, K / 32 * block bytes] uint8 of `ggml_type` (one of KERNEL_TYPES) for a
    weight of `shape` (O, K), bias [O] fp32 or None -> y [N, O] fp32; exact_x, x16 (one at most): see the module
    doc."""
    if exact_x and ggml_type not in EXACT_X_TYPES:
        raise ValueError(f"exact_x is for {', '.join(t.name for t in EXACT_X_TYPES)} blocks, not {ggml_type.name}")
    if x16 and (exact_x or ggml_type not in X16_TYPES):
        raise ValueError(f"x16 is for {', '.join(t.name for t in X16_TYPES)} blocks without exact_x, "
                         f"not {ggml_type.name}{' with exact_x' if exact_x else ''}")
    O, K = shape
    lib = library()
    if (lib is None or (ggml_type not in KERNEL_TYPES and not (x16 and ggml_type in X16_TYPES))
            or x.dtype != torch.float32 or x.device.type != "cpu"
            or not x.is_contiguous() or not raw.is_contiguous() or x.dim() != 2 or x.shape[1] != K
            or K % row_values(ggml_type)
            or (bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()))):
        return naive_ggml_gemv(x, raw, ggml_type, shape, bias, exact_x, x16)
    N = x.shape[0]
    y = x.new_empty(N, O)
    scratch = torch.empty(lib.ggml_gemv_scratch(N, K), dtype=torch.uint8)
    if lib.ggml_gemv(x.data_ptr(), N, K, raw.data_ptr(), int(ggml_type), O, None if bias is None else bias.data_ptr(),
                     y.data_ptr(), scratch.data_ptr(), threads(), 2 if x16 else int(exact_x)):
        raise ValueError(f"ggml_gemv refused {ggml_type.name} [{O}, {K}]")
    return y


ROW_TYPES = (Q.Q8_0, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q8_0_R16)  # dequantise_rows in C (an embedding's lookup; Q8_0_R16: a tied
# x16 head's table)


def dequantize_rows(table: torch.Tensor, ids: torch.Tensor, ggml_type, K: int) -> torch.Tensor | None:
    """Rows `ids` (int64 [n]) of `table` (uint8 [rows, row bytes] GGUF blocks of `ggml_type`, K values a row)
    dequantised -> fp32 [n, K], the bits of quant/ggml.py's dequantiser (ggml_cpu.cpp `ggml_dequantize_rows`);
    None where the library or the type (ROW_TYPES) is not there, for the caller's torch path."""
    lib = library()
    if lib is None or ggml_type not in ROW_TYPES or not table.is_contiguous() or table.device.type != "cpu":
        return None
    ids = ids.to(torch.int64).contiguous()
    out = torch.empty(ids.numel(), K, dtype=torch.float32)
    if lib.ggml_dequantize_rows(table.data_ptr(), table.shape[1], ids.data_ptr(), ids.numel(), int(ggml_type), K,
                                out.data_ptr()):
        return None
    return out


def dequantize_row(table: torch.Tensor, index: int, ggml_type, K: int) -> torch.Tensor | None:
    """Row `index` of `table` dequantised -> fp32 [K], as `dequantize_rows` (one token's lookup with no tensor of ids);
    None where that would be, or for an index outside the table (the caller's path raises)."""
    lib = library()
    if (lib is None or ggml_type not in ROW_TYPES or not 0 <= index < table.shape[0] or not table.is_contiguous()
            or table.device.type != "cpu"):
        return None
    out = torch.empty(K, dtype=torch.float32)
    ids = ctypes.c_int64(index)
    if lib.ggml_dequantize_rows(table.data_ptr(), table.shape[1], ctypes.addressof(ids), 1, int(ggml_type), K,
                                out.data_ptr()):
        return None
    return out


def row_reader(table: torch.Tensor, ggml_type, K: int):
    """A decode step's one-token lookup in `table` (as `dequantize_rows`' arguments): read(index) dequantises row `index`
    into an fp32 [K] buffer it keeps and returns that buffer's address (overwritten by the next read: copy it before);
    one library call with its arguments bound once. No bounds check (the caller's). None where `dequantize_rows` would
    give None."""
    lib = library()
    if lib is None or ggml_type not in ROW_TYPES or not table.is_contiguous() or table.device.type != "cpu":
        return None
    out, index, fn = torch.empty(K, dtype=torch.float32), ctypes.c_int64(0), lib.ggml_dequantize_rows
    args = (table.data_ptr(), table.shape[1], ctypes.addressof(index), 1, int(ggml_type), K, out.data_ptr())

    def read(i: int) -> int:
        index.value = i
        if fn(*args):
            raise ValueError(f"ggml_dequantize_rows refused {ggml_type!r} rows")
        return args[6]

    read.held = (table, out, index)  # alive while the reader is
    return read


__all__ = ["EXACT_X_TYPES", "KERNEL_TYPES", "K_QUANTS", "MAX_ROWS", "Q4_1_R8", "Q4_K_R8", "Q6_K_R8", "Q8_0_R16", "ROW_TYPES", "TYPES", "X16_TYPES",
           "dequantize_row", "dequantize_rows", "ggml_gemv", "kernel_available", "naive_ggml_gemv", "q16_round", "row_reader", "row_values", "x_block"]
