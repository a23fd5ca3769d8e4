"""Multi-row GGUF block GEMV (`localmoe.kernels.ggml_gemv` with N = 1..32 tokens) against its peers, in one run.

For each block type (Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K on int8 x, and Q8_0 on fp32 x: the lm_head's
path) and an embedded-model-sized matrix (SmolLM2's 3072 x 576 gate/up, 576 x 1536 down; K-quants
take K = 768 / 1536), the kernel is timed at N tokens and compared in the same rounds with:
- N one-token calls (what a batched step would cost if each row re-read and re-decoded the weight),
- torch's fp32 F.linear on the dequantised weight (a compute/bandwidth peer: an sgemm on 8x the bytes).
Rounds alternate the three, so the ratios see the same machine load. `speedup` > 1: the N-row call
beats N one-row calls; `vs fp32` > 1: it beats torch's GEMM on a fp32 copy.

    .venv/bin/python benchmarks/ggml_gemm.py [--rounds 5] [--threads 2] [--n 1,2,4,8,16,32] [--isa avx2]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from functools import partial

import numpy as np

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # torch's idle OpenMP threads would spin against the kernel's pool
import torch
import torch.nn.functional as F


def _blocks(ggml_type, O: int, K: int, seed: int) -> torch.Tensor:
    import gguf
    from localmoe.kernels.ggml_gemv import K_QUANTS

    from localmoe.testing.ggml_blocks import random_blocks

    rng = np.random.default_rng(seed)
    if ggml_type in K_QUANTS:
        return torch.from_numpy(random_blocks(ggml_type, O, K, rng))
    w = rng.standard_normal((O, K)).astype(np.float32) * 0.05
    return torch.from_numpy(gguf.quants.quantize(w, ggml_type).copy())


def _time(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--n", default="1,2,4,8,16,32")
    ap.add_argument("--isa", default=None, help="force the CPU library's ISA (avx2 or avx512vnni)")
    args = ap.parse_args()
    if args.isa:
        os.environ["LOCALMOE_CPU_ISA"] = args.isa
    torch.set_num_threads(args.threads)
    from gguf import GGMLQuantizationType as Q
    from localmoe.kernels._cpu import describe, library
    from localmoe.kernels.ggml_gemv import ggml_gemv

    from localmoe.quant.ggml import dequantize

    if library() is None:
        raise SystemExit("the CPU kernel library is unavailable")
    print(f"CPU kernels: {describe()}; rounds {args.rounds}; median of per-round ratios")
    ns = [int(n) for n in args.n.split(",")]
    cases = [(Q.Q4_1, 3072, 576, False), (Q.Q4_1, 576, 1536, False), (Q.Q4_0, 3072, 576, False),
             (Q.Q8_0, 3072, 576, False), (Q.Q4_K, 3072, 768, False), (Q.Q5_K, 3072, 768, False),
             (Q.Q6_K, 3072, 768, False), (Q.Q8_0, 3072, 576, True)]
    print(f"{'type':<10} {'O x K':>11} {'N':>3} {'us/call':>9} {'us/row':>8} {'speedup vs N x 1-row':>21} "
          f"{'vs fp32 F.linear':>17}")
    for ggml_type, O, K, exact in cases:
        raw = _blocks(ggml_type, O, K, seed=O + K)
        w = dequantize(raw, ggml_type, (O, K), torch.float32)
        x_all = torch.randn(max(ns), K, generator=torch.Generator().manual_seed(0))
        repeats = max(3, int(2e6 / raw.nbytes))
        one = x_all[:1].contiguous()
        for n in ns:
            x = x_all[:n].contiguous()
            ours, rows, dense = [], [], []
            call = partial(ggml_gemv, raw=raw, ggml_type=ggml_type, shape=(O, K), exact_x=exact)
            for _ in range(args.rounds):
                ours.append(_time(partial(call, x), repeats))
                rows.append(n * _time(partial(call, one), repeats))
                dense.append(_time(partial(F.linear, x, w), repeats))
            speedup = statistics.median(r / o for r, o in zip(rows, ours))
            vs_dense = statistics.median(d / o for d, o in zip(dense, ours))
            t = statistics.median(ours)
            name = ggml_type.name + (" fp32x" if exact else "")
            print(f"{name:<10} {f'{O}x{K}':>11} {n:>3} {t * 1e6:>9.0f} {t / n * 1e6:>8.1f} {speedup:>20.2f}x "
                  f"{vs_dense:>16.2f}x", flush=True)


if __name__ == "__main__":
    main()
