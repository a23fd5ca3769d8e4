"""Linear layers whose weight dtype is chosen by measurement.

On CPUs without AMX, bf16 `F.linear` is fast for GEMV (a few rows) but pathological
for GEMM, while fp32 is good at both. A `Linear` keeps ONE copy of its weight: in fp32,
or in bf16 when bf16 GEMV measured faster for that shape, in which case prefill-sized
inputs upcast the weight on the fly (cheap next to a GEMM).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

COLD_BYTES = 96 << 20  # more than any desktop CPU's last-level cache
GEMV_MAX_ROWS = 8  # above this many input rows a call is a GEMM: always compute in fp32

_choice_cache: dict[tuple[int, int, int], torch.dtype] = {}


def _time(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measured_gemv_dtype(out_features: int, in_features: int) -> torch.dtype:
    """The faster weight dtype (fp32 or bf16) for a one-row F.linear of this shape here.

    Decode streams every weight from RAM once per token, so the timing rotates over
    enough copies to overflow the last-level cache: a single hot matrix would make fp32
    look fast because it never leaves L2/L3.
    """
    key = (out_features, in_features, torch.get_num_threads())
    if key not in _choice_cache:
        copies = max(2, (COLD_BYTES // (4 * out_features * in_features)) + 1)
        timings = {}
        for dtype in (torch.float32, torch.bfloat16):
            weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
            x = torch.randn(1, in_features).to(dtype)

            def sweep():
                for w in weights:
                    F.linear(x, w)

            timings[dtype] = _time(sweep, 5)
        # bf16 must win clearly: it also costs precision and a cast per call.
        _choice_cache[key] = torch.bfloat16 if timings[torch.bfloat16] < 0.8 * timings[torch.float32] else torch.float32
    return _choice_cache[key]


class Linear:
    """y = x W^T (+ b) with x, y in fp32; W [out, in] stored in fp32 or bf16."""

    __slots__ = ("weight", "bias", "low_precision")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: str):
        target = torch.float32
        if dtype == "bfloat16":
            target = torch.bfloat16
        elif dtype == "auto":
            target = measured_gemv_dtype(*weight.shape)
        self.weight = weight.to(target).contiguous()
        self.low_precision = target != torch.float32
        self.bias = None if bias is None else bias.float()

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if not self.low_precision:
            return F.linear(x, self.weight, self.bias)
        if x.numel() <= GEMV_MAX_ROWS * x.shape[-1]:
            y = F.linear(x.to(self.weight.dtype), self.weight).float()
        else:
            y = F.linear(x, self.weight.float())
        return y if self.bias is None else y + self.bias

    def nbytes(self) -> int:
        return self.weight.nbytes + (0 if self.bias is None else self.bias.nbytes)
