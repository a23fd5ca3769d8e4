"""Helpers shared by the benchmarks: timing, memory bandwidth, printing."""

from __future__ import annotations

import time

import torch


def memory_read_bandwidth(bytes_: int = 1 << 29, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes/s a plain read streams from RAM on the current torch thread count (per second of `clock`: pass
    time.process_time to match engines timed by CPU time on a loaded machine): the CPU library's chunked sum
    (kernels/dense_gemv `read_sums`; torch's sum where the library is missing, which reads ~1.5-2x slower on
    one thread), over huge pages as the engine keeps its weights (kernels/_cpu/pages.py)."""
    from localmoe.kernels._cpu import library
    from localmoe.kernels._cpu.pages import huge_copy
    from localmoe.kernels.dense_gemv.cpu import read_sums

    buffer = huge_copy(torch.ones(bytes_ // 4, dtype=torch.float32))
    read = read_sums if library() is not None else torch.sum
    read(buffer)
    best = float("inf")
    for _ in range(repeats):
        start = clock()
        read(buffer)
        best = min(best, clock() - start)
    return bytes_ / best


def report(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
