"""Helpers shared by the benchmarks: timing, memory bandwidth, printing."""

from __future__ import annotations

import time

import torch


def memory_read_bandwidth(bytes_: int = 1 << 29, repeats: int = 5) -> float:
    """Bytes/s a full-width reduction streams from RAM on the current torch thread count, from huge pages as the
    engine keeps its weights (kernels/_cpu/pages.py; on 4 KiB pages the same sum streams ~1.5x slower)."""
    from localmoe.kernels._cpu.pages import huge_copy

    buffer = huge_copy(torch.ones(bytes_ // 4, dtype=torch.float32))
    buffer.sum()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return bytes_ / best


def report(rows: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
