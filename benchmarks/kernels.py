"""MXFP4 expert kernels against this machine's limits and against plain torch, in one run.

CPU (always): for K3-sized (3072 x 3584 and its down projection 3584 x 3072) and gpt-oss-sized
(2880 x 2880) expert matrices, the MXFP4 GEMV (`localmoe.kernels.mxfp4_moe.mxfp4_linear`,
1-8 tokens) is timed streaming a working set well above the last-level cache; its achieved
bytes/s (codes + scales) is divided by the memory read bandwidth measured in the same process
with the same threads (a large fp32 sum and a copy, interleaved with the kernel rounds so both
see the same load), and its time is compared with dequantise-then-matmul in plain torch
(`store.mxfp4.dequantize` + F.linear, what the engine did before). Prefill sizes compare the
dispatcher's dequantise + sgemm with the same plain-torch path; the GEMV/sgemm crossover is
printed to justify `GEMV_MAX_TOKENS`.

GPU (when CUDA and Triton are present): the Triton MXFP4 grouped GEMV's bytes/s over the
device's copy bandwidth, and the KDA kernels' tokens/s.

    .venv/bin/python benchmarks/kernels.py [--threads N] [--rounds 5] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import report

SHAPES = {"k3 gate/up 3072x3584": (3072, 3584), "k3 down 3584x3072": (3584, 3072), "gpt-oss 2880x2880": (2880, 2880)}


def _random_mxfp4(O: int, K: int, count: int, device: str = "cpu") -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` valid MXFP4 matrices (random codes, scales around 2^-6), made without quantising."""
    g = torch.Generator().manual_seed(O * K)
    return [(torch.randint(0, 256, (O, K // 2), dtype=torch.uint8, generator=g).to(device),
             torch.randint(118, 124, (O, K // 32), dtype=torch.uint8, generator=g).to(device)) for _ in range(count)]


def _best(fn, repeats: int, *args) -> float:
    """Best wall time of fn(*args) over `repeats` calls, after one warm-up call."""
    fn(*args)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        best = min(best, time.perf_counter() - start)
    return best


def _each(fn, x, mats) -> None:
    for p, s in mats:
        fn(x, p, s)


def _torch_path(x, p, s):
    from localmoe.store.mxfp4 import dequantize

    return F.linear(x, dequantize(p, s))


def _sgemm_path(x, p, s):
    from localmoe.kernels.mxfp4_moe import cpu

    return F.linear(x, cpu.dequantize(p, s))


def _bandwidth(buffer: torch.Tensor, out: torch.Tensor) -> float:
    """Read bandwidth, bytes/s: the better of a full sum and a copy (read + write counted)."""
    t_sum = _best(buffer.sum, 2)
    t_copy = _best(out.copy_, 2, buffer)
    return max(buffer.nbytes / t_sum, 2 * buffer.nbytes / t_copy)


def cpu_bench(rounds: int, quick: bool) -> None:
    from localmoe.kernels.mxfp4_moe import GEMV_MAX_TOKENS, cpu, mxfp4_linear

    if cpu.library() is None:
        print("CPU kernel unavailable: only the reference would run; nothing to compare")
        return
    threads = torch.get_num_threads()
    buffer = torch.ones((1 << 28) // 4)  # 256 MiB, far above any last-level cache
    out = torch.empty_like(buffer)
    print(f"CPU, {threads} threads: MXFP4 GEMV bytes/s over memory bandwidth (same run), speed over torch")
    for name, (O, K) in SHAPES.items():
        mats = _random_mxfp4(O, K, 4 if quick else 12)  # 12 x ~6 MB: well above a 32 MB L3
        nbytes = sum(p.nbytes + s.nbytes for p, s in mats)
        rows = []
        for N in (1, 4, 8):
            x = torch.randn(N, K)
            ratios, speeds = [], []
            for _ in range(rounds):
                bw = _bandwidth(buffer, out)
                t_kernel = _best(_each, 3, mxfp4_linear, x, mats)
                ratios.append(nbytes / t_kernel / bw)
                speeds.append((nbytes / t_kernel, bw))
            p, s = mats[0]
            t_torch = _best(_torch_path, 2, x, p, s)
            t_one = _best(mxfp4_linear, 5, x, p, s)
            got, bw = max(speeds)
            rows.append((f"{name} N={N}", (f"{got / 1e9:6.2f} GB/s over {bw / 1e9:5.2f} GB/s: "
                                           f"median {statistics.median(ratios):.2f}, best {max(ratios):.2f}; "
                                           f"{t_torch / t_one:5.1f}x dequantise+matmul")))
        report(rows)
    O, K = SHAPES["k3 gate/up 3072x3584"]
    p, s = _random_mxfp4(O, K, 1)[0]
    rows = []
    for N in (16, 32, 64, 128) if quick else (16, 32, 64, 128, 512):
        x = torch.randn(N, K)
        t_gemv = _best(cpu.gemv, 3, x, p, s)
        t_sgemm = _best(_sgemm_path, 3, x, p, s)
        t_torch = _best(_torch_path, 2, x, p, s)
        path, t_path = ("gemv", t_gemv) if N <= GEMV_MAX_TOKENS else ("dequantise+sgemm", t_sgemm)
        rows.append((f"k3 3072x3584 N={N}", (f"gemv/sgemm time {t_gemv / t_sgemm:5.2f} (dispatcher: {path}); "
                                             f"dispatcher {t_torch / t_path:5.1f}x dequantise+matmul")))
    print(f"CPU crossover (GEMV_MAX_TOKENS = {GEMV_MAX_TOKENS}) and prefill:")
    report(rows)


def gpu_bench() -> None:
    from localmoe.kernels._triton import HAVE_TRITON

    if not (torch.cuda.is_available() and HAVE_TRITON):
        print("GPU: skipped (needs CUDA and triton)")
        return
    from localmoe.kernels.kda import chunk_kda, recurrent_kda
    from localmoe.kernels.mxfp4_moe import triton as tk

    dev = "cuda"
    buf = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(buf)

    def timed(fn, *args, repeats=10):
        fn(*args)
        torch.cuda.synchronize()
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            fn(*args)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - start)
        return best

    bw = 2 * buf.nbytes / timed(dst.copy_, buf)
    print(f"GPU {torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s")
    rows = []
    for name, (O, K) in SHAPES.items():
        E = 32
        packed, scales = (t.to(dev) for t in _random_mxfp4(O, K, 1)[0])
        packed, scales = packed.expand(E, O, K // 2).contiguous(), scales.expand(E, O, K // 32).contiguous()
        for N in (1, 8):
            x = torch.randn(N * E, K, device=dev, dtype=torch.bfloat16)
            ids = torch.arange(E, device=dev).repeat_interleave(N)
            t = timed(tk.mxfp4_grouped, x, packed, scales, ids)
            ratio = (packed.nbytes + scales.nbytes) / t / bw
            rows.append((f"{name} x{E} experts N={N}", f"{ratio:.2f} of copy bandwidth"))
    B, H, K = 1, 32, 128
    for T, fn in ((1, recurrent_kda), (4096, chunk_kda)):
        q, k, v = (torch.randn(B, T, H, K, device=dev) for _ in range(3))
        k = F.normalize(k, dim=-1)
        g = -torch.rand(B, T, H, K, device=dev) * 0.1
        beta = torch.rand(B, T, H, device=dev)
        s = torch.zeros(B, H, K, K, device=dev)
        t = timed(fn, q, k, v, g, beta, s)
        rows.append((f"kda {fn.__name__} T={T} H={H} K={K}", f"{B * T / t:,.0f} tokens/s"))
    report(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cpu_bench(args.rounds, args.quick)
    gpu_bench()


if __name__ == "__main__":
    main()
