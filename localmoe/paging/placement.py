"""Where to compute an expert, and how fast decode will be: a cost model over measured bandwidths.

Decode at batch 1 is bandwidth-bound: an expert costs the bytes that must move to where it
is computed. For an expert in host RAM and not on the GPU, `place` compares computing it on
the CPU (its MXFP4 bytes streamed through the CPU's expert throughput) with copying it over
PCIe and computing it on the GPU. Bandwidths are measured (`measure`) or injected (tests,
what-if plans); nothing here needs a GPU.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Bandwidths:
    """Bytes per second (per-expert fixed costs in seconds)."""

    disk: float  # extents read into RAM, the pager's parallel O_DIRECT reads
    cpu_expert: float  # MXFP4 expert bytes the CPU computes through per second at batch 1
    pcie: float = 0.0  # host (pinned) -> GPU; 0 = no GPU
    gpu_expert: float = 0.0  # expert bytes a GPU computes through per second
    gpu_overhead: float = 20e-6  # launch + sync per expert on the GPU


@dataclass(frozen=True, slots=True)
class Placement:
    where: str  # "cpu" | "gpu"
    cpu_seconds: float
    gpu_seconds: float


def place(nbytes: int, tokens: int, bw: Bandwidths, on_gpu: bool = False) -> Placement:
    """Where to compute one expert of `nbytes` for `tokens` tokens, given where it lives.

    CPU time grows with tokens (each token streams the weights again once they leave cache,
    roughly: one pass per 8 tokens); the GPU pays the copy once unless it already holds it."""
    cpu = nbytes / bw.cpu_expert * max(1.0, tokens / 8)
    if bw.pcie <= 0 or bw.gpu_expert <= 0:
        return Placement("cpu", cpu, float("inf"))
    gpu = (0.0 if on_gpu else nbytes / bw.pcie) + nbytes / bw.gpu_expert + bw.gpu_overhead
    return Placement("gpu" if gpu < cpu else "cpu", cpu, gpu)


def predict_decode(active_per_token: int, slot_bytes: int, ram_hit_rate: float, bw: Bandwidths,
                   dense_bytes: int = 0, ram_bandwidth: float = 0.0, overlap: float = 0.0,
                   gpu_hit_rate: float = 0.0) -> float:
    """Predicted decode tokens/s: per token, `active_per_token` experts, of which the misses are
    read from disk (a fraction `overlap` of that hidden behind compute), the rest computed where
    they are (placement per expert), plus the dense weights streamed once."""
    misses = active_per_token * (1.0 - ram_hit_rate)
    disk = misses * slot_bytes / bw.disk
    on_gpu = active_per_token * gpu_hit_rate
    host = active_per_token - on_gpu
    best = place(slot_bytes, 1, bw)
    compute = host * min(best.cpu_seconds, best.gpu_seconds)
    if on_gpu:
        compute += on_gpu * place(slot_bytes, 1, bw, on_gpu=True).gpu_seconds
    dense = dense_bytes / ram_bandwidth if ram_bandwidth > 0 else 0.0
    per_token = max(disk * (1.0 - overlap), 0.0) + max(compute + dense, disk * overlap)
    return 1.0 / per_token if per_token > 0 else float("inf")


def measure_disk(store, samples: int = 16, threads: int = 4) -> float:
    """Bytes/s of O_DIRECT extent reads, `threads` at a time, page cache dropped first."""
    from localmoe.paging.disk import make_backend
    from localmoe.paging.slab import HostSlab

    layers = store.layers()
    keys = [(layers[i % len(layers)], store.experts_in(layers[i % len(layers)])[(i * 7) % len(
        store.experts_in(layers[i % len(layers)]))]) for i in range(samples)]
    slot = max(store.layout(layer).slot_bytes for layer in layers)
    slab = HostSlab(threads, slot, pin=False)
    backend = make_backend("odirect" if hasattr(os, "O_DIRECT") else "mmap", store, verify=False)
    for layer in layers:
        fd = os.open(store.expert_extent(layer, store.experts_in(layer)[0]).path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        done = sum(pool.map(lambda ik: backend.read(*ik[1], slab.slot(ik[0] % threads)), enumerate(keys)))
    backend.close()
    return done / (time.perf_counter() - started)


def measure_cpu_expert(store, repeats: int = 3) -> float:
    """MXFP4 bytes/s the CPU computes one expert through at batch 1 (dequantise + GEMV)."""
    import torch

    from localmoe.engine.experts import ExpertWeights, expert_forward
    from localmoe.engine.layers.moe import swiglu

    layer = store.layers()[0]
    w = ExpertWeights.from_parts(store.expert(layer, store.experts_in(layer)[0]))
    x = torch.randn(1, w.gate.dense().shape[1])
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        expert_forward(w, x, swiglu)
        best = min(best, time.perf_counter() - started)
    return store.layout(layer).slot_bytes / best


def measure_pcie(nbytes: int = 256 << 20) -> float:
    """Pinned host -> GPU 0 bytes/s; 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - started)


def measure_gpu_expert(store, device, repeats: int = 3) -> float:
    """MXFP4 bytes/s `device` computes one expert of `store` through at batch 1 (the first call, which
    compiles the Triton kernel on CUDA, is not timed)."""
    import torch

    from localmoe.engine.experts import ExpertWeights, expert_forward
    from localmoe.engine.layers.moe import swiglu

    layer = store.layers()[0]
    w = ExpertWeights.from_parts({k: t.to(device) for k, t in store.expert(layer, store.experts_in(layer)[0]).items()})
    x = torch.randn(1, w.gate.dense().shape[1], device=device)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    expert_forward(w, x, swiglu)
    sync()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        expert_forward(w, x, swiglu)
        sync()
        best = min(best, time.perf_counter() - started)
    return store.layout(layer).slot_bytes / best


def measure_devices(store, device) -> Bandwidths:
    """What placement needs for GPU tiers on `device`: the CPU's and the GPU's expert throughput and
    host -> GPU bandwidth (no disk figure: placement does not use it)."""
    return Bandwidths(disk=0.0, cpu_expert=measure_cpu_expert(store), pcie=measure_pcie(),
                      gpu_expert=measure_gpu_expert(store, device))


def measure(store) -> Bandwidths:
    pcie = measure_pcie()
    return Bandwidths(disk=measure_disk(store), cpu_expert=measure_cpu_expert(store), pcie=pcie,
                      gpu_expert=measure_gpu_expert(store, "cuda") if pcie else 0.0)


def ram_bandwidth(nbytes: int = 1 << 28) -> float:
    a = np.ones(nbytes // 8)
    started = time.perf_counter()
    a.sum()
    return nbytes / (time.perf_counter() - started)
