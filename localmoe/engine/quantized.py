"""Weights kept in their GGML block format (kernels/ggml_gemv.KERNEL_TYPES: a Q4_K matrix repacked at load too,
`repack_blocks`) for decode GEMVs.

A GGUF Q4_0 / Q4_1 matrix stays 4.5-5 bits per weight instead of becoming a bf16 copy
(3.6x the bytes), a Q8_0 one 8.5 bits (1.9x less): decode reads every weight once per token,
so bytes are time.

Where the CPU kernel library is built, decode-sized calls run `kernels/ggml_gemv` on the file's
own blocks (x rounded to int8 per 32 values, as llama.cpp does; ~3x torch's int4 GEMV on the
embedded model's matrices). Otherwise `torch.ops.aten._weight_int4pack_mm_for_cpu` computes
y = x W^T for the 4-bit types (Q8_0 blocks need the library) with W given as 4-bit
codes q in 0..15 and per-32-column (scale, zero) pairs, w = (q - 8) * scale + zero:
- Q4_0 (d, 16 bytes of nibbles): w = d (q - 8)  -> scale d, zero 0
- Q4_1 (d, m, 16 bytes):         w = d q + m    -> scale d, zero m + 8 d
Scales and activations are bf16 in that kernel (d and m are fp16 in the file, so the
scales lose 3 mantissa bits: an error of the same order as a bf16 copy of the weights).
Measured on 2 Zen 3 cores: 2.0-2.5x faster than bf16 `F.linear` for one row.

Inside `decode_rows()` (a batched decode step, engine/batch.py) calls of up to `ggml_gemv.MAX_ROWS`
rows run the same kernel, which decodes each weight block once for a tile of rows and gives every row
the bits it has alone (`independent_rows`); inside `rounded_rows()` (a MoE model at expert precision q8)
K-quant matrices run it on any number of rows (prefill too: faster than the GEMM below, ROUNDED_TYPES), inside
`block_rows()` (a draft model's catch-up) every type does. Elsewhere calls of more than GEMV_MAX_ROWS rows are prefill
chunks and run an fp32 GEMM on the dequantised weight, on fp32 x. (The kernel matches that GEMM's
speed up to 512 rows, measured in docs/performance.md, and would spare the fp32 copy below, but it
would round prefill's x to int8: a change of numerics left to a decision of its own.) Dequantising costs more than the GEMM of a 512-token chunk, so the first such call
keeps the fp32 copy, within `PREFILL_COPY_BYTES` for the whole process (the embedded 135M
model needs 0.5 GiB); past the budget each call dequantises again.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType

from localmoe.kernels import ggml_gemv
from localmoe.kernels._cpu.pages import huge_copy
from localmoe.kernels.ggml_gemv.repacked import RepackedType, can_repack, plain_type, repack, unpack
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS  # above it: dequantise to fp32 and run a GEMM
from localmoe.quant.ggml import dequantize

INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)  # torch's int4 GEMV takes these
GROUP = 32  # elements per GGML block (and per int4pack scale group)
PREFILL_COPY_BYTES = 1 << 30  # fp32 copies of 4-bit weights kept for prefill, in all (see the module doc)
_copied = [0]  # bytes of fp32 copies alive
_rows = threading.local()  # .decode: inside decode_rows(); .rounded: inside rounded_rows(); .blocks: block_rows()


@contextmanager
def _flag(name: str) -> Iterator[None]:
    """`_rows.<name>` is True inside (this thread's, restored after: calls nest)."""
    before = getattr(_rows, name, False)
    setattr(_rows, name, True)
    try:
        yield
    finally:
        setattr(_rows, name, before)


def decode_rows():
    """Calls inside run decode rows of a batched step: up to ggml_gemv.MAX_ROWS rows through the block
    kernel, each row computed on its own (see the module doc)."""
    return _flag("decode")


def in_decode_rows() -> bool:
    """Whether calls now run a batched step's rows (inside `decode_rows()`)."""
    return getattr(_rows, "decode", False)


def rounded_rows():
    """Calls inside are a MoE model's steps at expert precision q8 (Transformer._forward), whose block GEMVs round
    their inputs to int8 anyway: a BlockLinear of ROUNDED_TYPES runs the block kernel on any number of rows (a
    prefill chunk's x rounded per block, each row on its own) instead of the fp32 GEMM on the dequantised weight,
    which it outruns (ROUNDED_TYPES) and whose fp32 copy it spares."""
    return _flag("rounded")


def block_rows():
    """Calls inside run every BlockLinear's block kernel on any number of rows (a prompt chunk's x rounded per block,
    each row on its own, as its decode rows are) instead of the fp32 GEMM on the dequantised weight: a draft model's
    catch-up (engine/spec/draft_model.py), whose drafts the target verifies (losslessly), so its numerics are its
    own. No fp32 copy is made (the embedded model's: 0.5 GiB, 0.40-0.46 s to dequantise at the first prefill), and
    the Q4_1_R8 kernel outruns the GEMM at a prompt's rows (AVX-512 VNNI, one thread: 177 rows 0.15 s against 0.45,
    11 rows 0.017 against 0.073; docs/performance.md, session 17). A model's own prefill keeps the fp32 GEMM: its
    prompt's logits are what the parity tests and the answers are checked against, and rounding x to int8 there is
    a change of numerics (the module docstring)."""
    return _flag("blocks")


# The block kernel against the fp32 GEMM on the dequantised weight, one Zen 4 core, 72 / 256 / 512 rows: Q4_K
# 1024 x 1024 1.23x / 1.12x / 1.09x, 2048 x 1024 1.37x / 1.24x / 1.04x; Q6_K 256 x 1024 1.03x / 0.95x / 0.88x
# (a Q4_K_M file's few Q6_K attn_v rows ride along with their layer's Q4_K q and k).
ROUNDED_TYPES = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K,
                 ggml_gemv.Q4_K_R8, ggml_gemv.Q6_K_R8)


def _kernel_rows() -> int:
    return ggml_gemv.MAX_ROWS if getattr(_rows, "decode", False) else GEMV_MAX_ROWS


def _release_copy(nbytes: int) -> None:
    _copied[0] -= nbytes


def int4_kernel_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")


def keeps_blocks(ggml_type) -> bool:
    """Whether a matrix of this GGML type can stay in its blocks (a decode GEMV exists for it)."""
    if ggml_gemv.kernel_available():
        return ggml_type in ggml_gemv.KERNEL_TYPES
    return ggml_type in INT4_TYPES and int4_kernel_available()


class BlockQuantized:
    """A 2-D weight as stored in the file: raw blocks [N, row bytes] + its GGML type and shape.

    The loader hands these to the model instead of dequantised tensors; `float()`
    dequantises (for code that needs a plain tensor), row permutations apply to the
    raw rows unchanged (`map_rows`). `ggml_type` may be a repacked type (kernels/ggml_gemv/repacked.py,
    `repack_blocks`): the kernels read it as it is, `float()` through its GGUF layout.
    """

    def __init__(self, raw: torch.Tensor, ggml_type: GGMLQuantizationType, shape: tuple[int, int]):
        self.raw, self.ggml_type, self.shape = raw, ggml_type, tuple(shape)

    def float(self) -> torch.Tensor:
        return dequantize(unpack(self.raw, self.ggml_type, self.shape[0]), plain_type(self.ggml_type), self.shape,
                          torch.float32)

    def map_rows(self, fn) -> BlockQuantized:
        """Apply a row reordering `fn(tensor [N, ...]) -> tensor [N, ...]` to the raw rows."""
        if isinstance(self.ggml_type, RepackedType):
            raise ValueError(f"{self.ggml_type.name} rows are repacked eight at a time: reorder them before repacking")
        return BlockQuantized(fn(self.raw), self.ggml_type, self.shape)

    def codes_scales_zeros(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q int32 [N, K] in 0..15, scale and zero fp32 [N, K/32] with w = (q - 8) scale + zero."""
        N, K = self.shape
        blocks = self.raw.reshape(N, K // GROUP, -1)  # [N, K/32, 18 or 20]
        header = 2 if self.ggml_type == GGMLQuantizationType.Q4_0 else 4
        halves = blocks[..., :header].contiguous().view(torch.float16).float()  # [N, K/32, 1 or 2]
        qs = blocks[..., header:].to(torch.int32)  # [N, K/32, 16]: byte j holds elements j and j+16
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(N, K)
        d = halves[..., 0]
        zero = torch.zeros_like(d) if header == 2 else halves[..., 1] + 8 * d
        return q, d, zero


# the names whose blocks stay in the GGUF layout: an embedding is read a row at a time (dequantize_rows), and a tied
# head is the embedding; the lm_head too unless it reads int8 inputs (`repack_blocks`' int8_head: the rows have no
# fp32-x or int16-x form repacked, engine/transformer.py `_head`) or int16 ones from Q8_0 blocks (x16_head)
UNREPACKED = ("embed_tokens.weight", "lm_head.weight")


def _repack_x16_head(weights: dict) -> None:
    """A Q8_0 lm_head that reads int16-rounded inputs (a dense model's at expert precision q8) replaced by its Q8_0_R16
    copy on 2 MiB pages (repacked.py: sixteen rows a group, read only by the x16 rows; the same bits). A tied head's
    is the embedding's too (one copy: its lookups dequantise rows from the repacked groups, the same values)."""
    name = next((n for n in weights if n.endswith("lm_head.weight")), None)
    name = name or next((n for n in weights if n.endswith("embed_tokens.weight")), None)
    t = dict.get(weights, name) if name is not None else None
    if (isinstance(t, BlockQuantized) and len(t.shape) == 2 and t.raw.device.type == "cpu"
            and can_repack(t.ggml_type, *t.shape, x16=True)):
        raw = t.raw.contiguous()
        held = huge_copy(raw)  # (raw itself where small: then a new tensor, the file's blocks left as they are)
        raw, kind = repack(raw, t.ggml_type, t.shape[0], out=None if held.data_ptr() == raw.data_ptr() else held,
                           x16=True)
        weights[name] = BlockQuantized(raw, kind, t.shape)


def repack_blocks(weights: dict, int8_head: bool = False, x16_head: bool = False) -> dict:
    """The loader's last step where GGUF blocks are kept resident on the CPU: every 2-D BlockQuantized with a repacked
    form (kernels/ggml_gemv/repacked.py: Q4_1, Q4_K or Q6_K of a multiple of eight rows) but UNREPACKED's (the lm_head's
    too where `int8_head`: the model's head reads x rounded to int8, engine/transformer.py `head_inputs`) is replaced
    by its repacked copy (the same bytes per eight rows; the file's are no longer referenced); where `x16_head` (the
    head reads int16-rounded inputs) a Q8_0 head by its Q8_0_R16 copy (`_repack_x16_head`). The kernels give the
    same bits on either layout, so a paged model (whose store keeps the GGUF layout) still equals the resident one.
    The copy lies on 2 MiB pages (kernels/_cpu/pages.py `huge_copy`, as the dense weights do): a decode token streams
    every one of these bytes, and from the file's 4 KiB pages the stream takes a TLB miss and a prefetcher stop every
    4 KiB (docs/performance.md, session 12). The other matrices the row kernels read every token (ggml_gemv.KERNEL_TYPES:
    Q5_0 / Q8_0 / Q5_K experts, a head left in the GGUF layout, the embedding where a tied head reads it) are copied
    there as they are; an untied embedding (a row a token) stays."""
    kept = ("embed_tokens.weight",) if int8_head else UNREPACKED
    if x16_head and not int8_head:
        _repack_x16_head(weights)
    tied = not any(name.endswith("lm_head.weight") for name in weights)  # the head reads the embedding's blocks
    for name in list(weights):
        t = dict.get(weights, name)
        if not (isinstance(t, BlockQuantized) and len(t.shape) == 2 and t.raw.device.type == "cpu"):
            continue
        if not name.endswith(kept) and can_repack(t.ggml_type, *t.shape):
            raw = t.raw.contiguous()
            held = huge_copy(raw)  # then repacked in place; the tensor itself where it stays (small, no THP)
            raw, kind = repack(raw, t.ggml_type, t.shape[0], out=None if held.data_ptr() == raw.data_ptr() else held)
            weights[name] = BlockQuantized(raw, kind, t.shape)
        elif t.ggml_type in ggml_gemv.KERNEL_TYPES and (tied or not name.endswith("embed_tokens.weight")):
            weights[name] = BlockQuantized(huge_copy(t.raw.contiguous()), t.ggml_type, t.shape)
    return weights


class BlockLinear:
    """y = x W^T (+ b) for W kept as GGML blocks (`keeps_blocks`); x, y fp32. Several parts stack as rows
    (q; k; v); with the CPU library they may differ in type (a Q4_K_M file's q, k in Q4_K and v in Q6_K):
    consecutive parts of one type share a segment, and a decode GEMV runs per segment."""

    __slots__ = ("__weakref__", "_dense", "bias", "exact_x", "ggml_type", "in_features", "out_features", "packed",
                 "parts", "raw", "scales_zeros", "segments", "x16")

    def __init__(self, parts: list[BlockQuantized], bias: torch.Tensor | None, exact_x: bool = False,
                 x16: bool = False):
        """exact_x: decode GEMVs keep x in fp32 (ggml_gemv.EXACT_X_TYPES with the CPU library; the lm_head); x16:
        they round x to int16 per 32 values (ggml_gemv.X16_TYPES: a dense model's Q8_0 lm_head) instead of int8."""
        self.parts = parts  # raw views, for prefill-sized inputs (dequantised per call)
        self.bias = None if bias is None else bias.float().contiguous()
        self.out_features, self.in_features = sum(p.shape[0] for p in parts), parts[0].shape[1]
        self._dense: torch.Tensor | None = None  # the fp32 copy for prefill, once made (within the budget)
        self.ggml_type = parts[0].ggml_type
        self.raw = self.packed = self.scales_zeros = None
        self.segments: list[tuple[torch.Tensor, GGMLQuantizationType, int]] = []  # (raw rows, type, rows)
        self.exact_x, self.x16 = exact_x, x16
        if exact_x and not (self.ggml_type in ggml_gemv.EXACT_X_TYPES and ggml_gemv.kernel_available()):
            raise ValueError(f"fp32 activations need {', '.join(t.name for t in ggml_gemv.EXACT_X_TYPES)} blocks and "
                             f"the CPU kernel library, not {self.ggml_type.name}")
        if x16 and (exact_x or self.ggml_type not in ggml_gemv.X16_TYPES or len(parts) != 1
                    or not ggml_gemv.kernel_available()):
            raise ValueError(f"int16 activations need one part of {', '.join(t.name for t in ggml_gemv.X16_TYPES)} "
                             f"blocks and the CPU kernel library, not {self.ggml_type.name}")
        if ggml_gemv.kernel_available():
            # the file's blocks, the rows of consecutive parts of one type stacked (a copy only where
            # several parts join); one segment (`raw`) unless the types differ
            joined = []
            for p in parts:
                rows = p.raw.reshape(p.shape[0], -1)
                if self.segments and self.segments[-1][1] == p.ggml_type:
                    raw, kind, n = self.segments[-1]
                    self.segments[-1] = (torch.cat([raw, rows]), kind, n + p.shape[0])
                    joined[-1] = True
                else:
                    self.segments.append((rows, p.ggml_type, p.shape[0]))
                    joined.append(False)
            # a joined copy on 2 MiB pages, as repack_blocks placed its parts: a decode token streams it (with the
            # embedded model's q;k;v and gate;up on 4 KiB pages its Q4_1 matrices took 3.5-4.2 ms of a 3-row step
            # against 2.7-2.9, 3.1 against 2.5-2.8 of a one-row step: docs/performance.md, session 17)
            self.segments = [(huge_copy(raw) if join else raw.contiguous(), kind, n)
                             for (raw, kind, n), join in zip(self.segments, joined)]
            if len(self.segments) == 1:
                self.raw = self.segments[0][0]
            return
        if not all(p.ggml_type in INT4_TYPES for p in parts):
            raise ValueError(f"{self.ggml_type.name} blocks need the CPU kernel library (kernels/ggml_gemv)")
        q, d, zero = zip(*(p.codes_scales_zeros() for p in parts))
        q, d, zero = torch.cat(q), torch.cat(d), torch.cat(zero)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        self.scales_zeros = torch.stack([d.t(), zero.t()], dim=-1).to(torch.bfloat16).contiguous()  # [K/32, N, 2]

    @property
    def independent_rows(self) -> int:
        """The most rows one call computes each on its own (a row's result not depending on the others)."""
        return _kernel_rows() if self.segments else GEMV_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        K = x.shape[-1]
        rows = x.numel() // K
        kernel_rows = _kernel_rows()
        if (rows > kernel_rows and not self.exact_x and not self.x16 and self.segments
                and (getattr(_rows, "blocks", False) or getattr(_rows, "rounded", False)
                     and all(kind in ROUNDED_TYPES for _, kind, _ in self.segments))):
            kernel_rows = rows  # block_rows(), rounded_rows()
        if rows <= kernel_rows and self.raw is not None:
            return ggml_gemv.ggml_gemv(x.reshape(rows, K).float().contiguous(), self.raw, self.ggml_type,
                                       (self.out_features, K), self.bias, self.exact_x,
                                       self.x16).view(*x.shape[:-1], self.out_features)
        if rows <= kernel_rows and self.segments:
            flat = x.reshape(rows, K).float().contiguous()
            y = torch.cat([ggml_gemv.ggml_gemv(flat, raw, kind, (n, K)) for raw, kind, n in self.segments], dim=1)
            y = y.view(*x.shape[:-1], self.out_features)
            return y if self.bias is None else y + self.bias
        if rows <= GEMV_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(rows, K).to(torch.bfloat16), self.packed,
                                                           GROUP, self.scales_zeros)
            y = y.float().reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self._prefill_weight())
        return y if self.bias is None else y + self.bias

    @property
    def device(self) -> torch.device:
        return self.parts[0].raw.device

    def _prefill_weight(self) -> torch.Tensor:
        if self._dense is not None:
            return self._dense
        weight = torch.cat([p.float() for p in self.parts])
        if _copied[0] + weight.nbytes <= PREFILL_COPY_BYTES:
            self._dense = weight
            _copied[0] += weight.nbytes
            weakref.finalize(self, _release_copy, weight.nbytes)
        return weight

    def nbytes(self) -> int:
        if self.segments:
            held = sum(raw.nbytes for raw, _, _ in self.segments)
        else:
            held = self.packed.nbytes + self.scales_zeros.nbytes
        return held + (0 if self.bias is None else self.bias.nbytes)


class BlockEmbedding:
    """A token embedding table kept as GGML blocks [vocab, row bytes]: looking tokens up dequantises
    their rows only (exactly the values of a whole-table dequantisation; Q8_0 / Q4_K / Q5_K / Q6_K rows in C,
    kernels/ggml_gemv dequantize_rows: 0.18 ms of torch ops per decode token before). A lookup reads one row per
    token, so a float copy of the table buys nothing: 2.1 GB in fp32 for 128K x 4096 against 0.3 GB
    as Q4_K, and a tied head (`BlockLinear` over the same blocks) shares them."""

    def __init__(self, weight: BlockQuantized):
        self.weight = weight
        self.rows = weight.raw.reshape(weight.shape[0], -1)  # [vocab, row bytes]

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [...] -> fp32 [..., D]."""
        flat = tokens.reshape(-1)
        rows = ggml_gemv.dequantize_rows(self.rows, flat, self.weight.ggml_type, self.weight.shape[1])
        if rows is None:
            rows = dequantize(self.rows.index_select(0, flat), self.weight.ggml_type,
                              (flat.numel(), self.weight.shape[1]), torch.float32)
        return rows.view(*tokens.shape, -1)

    def __getitem__(self, token) -> torch.Tensor:
        """One token's row, fp32 [D] (one library call where it can: 8.5 us hot against the general path's 14; the
        same values)."""
        row = ggml_gemv.dequantize_row(self.rows, int(token), self.weight.ggml_type, self.weight.shape[1])
        return self(torch.as_tensor(token).reshape(1))[0] if row is None else row

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes
