"""Linear layers whose weight dtype is chosen by measurement.

On CPUs without AMX, bf16 `F.linear` is fast for GEMV (a few rows) but pathological
for GEMM, while fp32 is good at both. A `Linear` keeps ONE copy of its weight: in fp32,
or in bf16 when bf16 GEMV measured faster on this machine, in which case prefill-sized
inputs upcast the weight on the fly (cheap next to a GEMM). Measured on SmolLM2-135M
(2 Zen 3 cores): 27 tokens/s with bf16 weights against 6 with fp32.

Every fp32 CPU input goes through the dense GEMV kernel (`localmoe.kernels.dense_gemv`: bf16 widened to fp32 in
registers, fp32 x and accumulation) where it is available: it computes each row with the same bits alone or among
others (`independent_rows`, engine/batch.py), which torch's GEMM does not (and its bf16 GEMV rounds x to bf16). One
or two rows stream the weight at memory bandwidth; from 3 rows the kernel runs register tiles of rows x outputs
(each weight vector loaded once per tile, dense_tiles.h), and a prompt chunk's rows in blocks that stay in L2: a
bf16 weight is read as bf16 (no widened copy, no GEMM packing), 1.0-1.4x torch's sgemm on the widened weight at
72-row chunks (session 12, docs/performance.md), each row with its one-row bits, so an exactly-bf16 weight stored as
bf16 or held as fp32 gives the same bits. Inside a batched step (`decode_rows()`) `independent_rows` is DECODE_ROWS
where the kernel takes the weight; torch's GEMM (the weight widened for it) serves the other inputs.
"""

from __future__ import annotations

import json
import os
import platform
import threading
import time

import torch
import torch.nn.functional as F

from localmoe.engine.quantized import BlockLinear, BlockQuantized, in_decode_rows, keeps_blocks
from localmoe.kernels import dense_gemv, ggml_gemv
from localmoe.kernels._cpu.pages import huge_copy
from localmoe.kernels.dense_gemv import GEMV_MAX_ROWS
from localmoe.paths import cache_dir

DECODE_ROWS = 64  # a batched step's rows per dense GEMV call (x: 64 x 2048 fp32 = 512 KiB, in L2)

COLD_BYTES = 96 << 20  # more than any desktop CPU's last-level cache

_choice_cache: dict[str, str] = {}  # "<path>@threads" -> dtype name, mirrored on disk per machine


def _choices_file():
    machine = f"{platform.machine()}-{platform.processor() or 'cpu'}-torch{torch.__version__}".replace("/", "_")
    return cache_dir() / "measurements" / f"gemv-dtype-{machine}.json"


def _load_choices() -> None:
    if not _choice_cache:
        try:
            _choice_cache.update(json.loads(_choices_file().read_text()))
        except (OSError, ValueError):
            pass


def _save_choices() -> None:
    path = _choices_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(_choice_cache, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-measurement next time


def _time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measured_gemv_dtype() -> torch.dtype:
    """bf16, unless this CPU's bf16 one-row GEMV is clearly slower than fp32's (then fp32).

    Times the path `Linear` really runs for one row (the dense GEMV kernel where it is available,
    torch's F.linear otherwise; each has its own cache key, so choices measured with the other
    path are not reused). Decided once per machine (and thread count) and remembered in the
    cache directory.
    Decode streams every weight from RAM once per token, so the timing rotates over
    enough copies to overflow the last-level cache: one hot matrix would make fp32 look
    fast because it never leaves L2/L3. bf16 moves half the bytes, so it should win
    wherever its GEMV kernel is sound; the check guards against CPUs where it is not.
    """
    _load_choices()
    kernel = dense_gemv.kernel_available()
    key = f"{'dense_gemv' if kernel else 'gemv'}@{torch.get_num_threads()}"
    if key not in _choice_cache:
        out_features, in_features = 4096, 1024  # a typical projection, 16 MiB in fp32
        copies = COLD_BYTES // (4 * out_features * in_features)
        x = {dtype: torch.randn(1, in_features).to(dtype) for dtype in (torch.float32, torch.bfloat16)}
        weights = {dtype: [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)] for dtype in x}

        def sweep(dtype):
            for w in weights[dtype]:
                if kernel:
                    dense_gemv.dense_gemv(x[torch.float32], w)
                else:
                    F.linear(x[dtype], w)

        best = {dtype: float("inf") for dtype in x}
        for _ in range(3):  # interleaved, best of 3: robust to a busy machine
            for dtype in x:
                best[dtype] = min(best[dtype], _time(lambda d=dtype: sweep(d), 1))
        _choice_cache[key] = "float32" if best[torch.bfloat16] > 1.25 * best[torch.float32] else "bfloat16"
        _save_choices()
    return getattr(torch, _choice_cache[key])


def holds_bf16(weight: torch.Tensor) -> bool:
    """Whether every value of `weight` is exactly a bf16 value (bf16 itself, or fp32 whose low 16 bits are all
    zero: e.g. a bf16 checkpoint written out as f32), so that storing it as bf16 loses nothing."""
    if weight.dtype == torch.bfloat16:
        return True
    if weight.dtype != torch.float32:
        return False
    bits = weight.detach().contiguous().view(torch.int32).reshape(-1)
    step = 1 << 22  # 16 MiB of fp32 at a time: no full-size temporary
    return all(not torch.any(bits[i:i + step] & 0xFFFF) for i in range(0, bits.numel(), step))


def engine_dtype(dtype: str) -> torch.dtype:
    """The dtype matrices are rounded to for engine dtype `dtype` (EngineConfig.dtype): "bfloat16" bf16, "auto" the
    measured GEMV dtype, else fp32."""
    if dtype == "bfloat16":
        return torch.bfloat16
    if dtype == "auto":
        return measured_gemv_dtype()
    return torch.float32


def stored_dtype(weights: list[torch.Tensor], dtype: str, compact: bool = True) -> torch.dtype:
    """The one dtype matrices `weights` are stored in for engine dtype `dtype`: `engine_dtype(dtype)`, or bf16 where
    that is fp32 and every value of every one is exactly bf16 (`holds_bf16`) on the CPU with the dense GEMV kernel
    there (`compact`: the same values at half the bytes, the same bits in every product)."""
    target = engine_dtype(dtype)
    if (target == torch.float32 and compact and weights and all(w.device.type == "cpu" for w in weights)
            and dense_gemv.kernel_available() and all(holds_bf16(w) for w in weights)):
        return torch.bfloat16
    return target


WIDEN_MAX = 64 << 20  # values: the largest weight widened into the reused buffer (256 MiB of fp32)
_widening = threading.local()


def _widened(weight: torch.Tensor) -> torch.Tensor:
    """A bf16 weight (exactly bf16 or rounded to it) as fp32 for a GEMM call: widened into a buffer each thread reuses (a fresh tensor
    per call cost ~8x the copy itself in page faults: 25 against 3.3 ms for 12.6M values, one thread); one over
    WIDEN_MAX values gets a tensor of its own."""
    n = weight.numel()
    if n > WIDEN_MAX:
        return weight.float()
    # one buffer inside inference mode, one outside: a tensor made in it cannot be written outside it
    name = "inference" if torch.is_inference_mode_enabled() else "normal"
    buffer = getattr(_widening, name, None)
    if buffer is None or buffer.numel() < n:
        buffer = torch.empty(n)
        setattr(_widening, name, buffer)
    return buffer[:n].view(weight.shape).copy_(weight)


class Linear:
    """y = x W^T (+ b) with x, y in fp32; W [out, in] stored in fp32 or bf16.

    Asked for fp32 (dtype "float32"), a CPU weight whose values are all exactly bf16 (`holds_bf16`, checked per
    tensor) is stored as bf16 where the dense GEMV kernel runs (`compact`): the same values, so the same bits in
    every product (the kernel widens bf16 to fp32 exactly and sums in the same order; prefill multiplies the
    weight widened back to fp32), at half the bytes a decode token streams. `compact=False` keeps an fp32
    tensor for callers that hand `weight` to kernels as fp32 (routers, gates)."""

    __slots__ = ("bias", "gemv", "low_precision", "weight")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: str, compact: bool = True):
        rounded = engine_dtype(dtype) != torch.float32  # values rounded to the stored dtype
        target = stored_dtype([weight], dtype, compact)  # an exact bf16 weight: low_precision stays False
        self.weight = huge_copy(weight.to(target).contiguous())  # streamed once per decode token: 2 MiB pages
        self.low_precision = rounded
        self.bias = None if bias is None else bias.float().contiguous()
        # the dense GEMV kernel's entry point for this weight, or None where it cannot take it
        self.gemv = dense_gemv.kernel_for(self.weight, self.bias)

    @property
    def independent_rows(self) -> int:
        """The most rows one call computes each on its own (engine/batch.py): DECODE_ROWS in a batched step where
        the kernel takes the weight, else GEMV_MAX_ROWS."""
        if self.gemv is not None and in_decode_rows():
            return DECODE_ROWS
        return GEMV_MAX_ROWS

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        K = x.shape[-1]
        rows = x.numel() // K
        if (self.gemv is not None and x.dtype == torch.float32 and x.device.type == "cpu"
                and K == self.weight.shape[1]):  # every such call: a row's bits do not depend on the others
            return self.gemv(x.reshape(rows, K).contiguous()).view(*x.shape[:-1], self.out_features)
        if not self.low_precision:  # fp32 values (a bf16-stored exact weight widened: the same product bits)
            w = self.weight if self.weight.dtype == torch.float32 else _widened(self.weight)
            return F.linear(x, w, self.bias)
        if x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
            y = F.linear(x.to(self.weight.dtype), self.weight).float()
        else:  # the rounded values widened into the reused buffer (as an exact weight's: no fresh tensor per call)
            y = F.linear(x, _widened(self.weight))
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)


def make_linear(parts: list, bias: torch.Tensor | None, dtype: str, compact: bool = True):
    """One linear layer from weight parts stacked as rows (e.g. [q, k, v]).

    Parts may be tensors or `BlockQuantized` weights from a GGUF: with dtype "auto" and every part
    in a GGML block type with a decode GEMV (`quantized.keeps_blocks`: kernels/ggml_gemv.KERNEL_TYPES; parts
    of different types need the CPU library), the weight stays in its blocks (`BlockLinear`);
    otherwise the parts are dequantised and concatenated into a `Linear`.
    """
    types = {p.ggml_type for p in parts if isinstance(p, BlockQuantized)}
    blocks = all(isinstance(p, BlockQuantized) for p in parts) and all(keeps_blocks(t) for t in types)
    if blocks and dtype == "auto" and (len(types) == 1 or ggml_gemv.kernel_available()):
        return BlockLinear(parts, bias)
    tensors = [p.float() if isinstance(p, BlockQuantized) else p for p in parts]
    return Linear(tensors[0] if len(tensors) == 1 else torch.cat(tensors), bias, dtype, compact)
