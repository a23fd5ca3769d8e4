"""MXFP4 expert kernels against this machine's limits and against plain torch, in one run.

CPU (always): for K3-sized (3072 x 3584 and its down projection 3584 x 3072) and gpt-oss-sized
(2880 x 2880) expert matrices, the MXFP4 GEMV (`localmoe.kernels.mxfp4_moe.mxfp4_linear`,
1-8 tokens, exact and q8 activations; the library built for the best ISA this CPU runs, or
LOCALMOE_CPU_ISA's) is timed streaming a working set well above the last-level cache; its achieved
bytes/s (codes + scales) is divided by the memory read bandwidth measured in the same process
with the same threads (a large fp32 sum and a copy, interleaved with the kernel rounds so both
see the same load), and its time is compared with dequantise-then-matmul in plain torch
(`quant.mxfp4.dequantize` + F.linear, what the engine did before). Prefill sizes compare the
dispatcher's dequantise + sgemm with the same plain-torch path; the GEMV/sgemm crossover is
printed to justify `GEMV_MAX_TOKENS`.

Fused MoE layer (CPU): one decode step of a gpt-oss-sized layer (top-4 of 16 experts of 2880 x 2880)
through `mxfp4_moe` (both GEMVs, the GLU and the weighted sum in one call): the chosen experts'
bytes/s over the same run's memory bandwidth, and speed over the per-expert path the engine ran
before (three dispatcher GEMVs, the GLU in torch and an index_add per expert).

Dense GEMV (CPU): `localmoe.kernels.dense_gemv` for decode-sized lm_heads and a projection, fp32
and bf16 weights, N = 1-8 tokens: achieved weight bytes/s over the same run's memory read
bandwidth, and speed over torch's F.linear (bf16: on x rounded to bf16, what the engine ran before);
then a batched step's 16 and 64 rows on gpt-oss `large`'s attention matrices: GFLOP/s over torch's sgemm.

GGUF block GEMV (CPU): `localmoe.kernels.ggml_gemv` straight from Q4_0 / Q4_1 / Q8_0 / Q4_K / Q6_K
blocks (x rounded to int8 per 32 values), a 4096 x 4096 projection, N = 1 and 4: block bytes/s over
the same run's memory bandwidth, and speed over the GEMV of a bf16 copy (dense_gemv), what a matrix
of a type without a block GEMV costs (K-quants before they had one).

GPU (when CUDA and Triton are present): benchmarks/gpu_kernels.py (the MXFP4 grouped GEMV's bytes/s over
the device's copy bandwidth beside torch's bf16 bmm, KDA / Gated DeltaNet tokens/s beside fla's, a
summary with each figure beside its goal).

End to end (--e2e): prefill tokens/s of a 2048-token prompt (in 512-token chunks on both sides, as
served) and greedy decode tokens/s of localmoe (resident, MXFP4 experts through the CPU
kernels with the default q8 expert precision) over llama.cpp's (llama-cpp-python, the same weights
written as a GGUF with MXFP4 experts by benchmarks/offload.py, same threads) on the `small`
generated gpt_oss checkpoint, each engine in its own process, twice: dense weights in fp32 on both
sides (GGUF F32), and in bf16 on both sides (GGUF BF16: the checkpoint's own dtype, what
convert_hf_to_gguf.py --outtype bf16 writes); "not installed" without llama-cpp-python.

    .venv/bin/python benchmarks/kernels.py [--threads N] [--rounds 5] [--quick] [--e2e] [--work DIR]
        [--dense-only|--moe-only|--ggml-only|--gpu-only]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from common import report

GOAL = 0.6  # GEMV bytes/s over memory bandwidth, one token (the kernels issue)
E2E_PROMPT = [17, 230]
E2E_PREFILL = 2048  # prompt tokens of the end-to-end prefill timing
DENSE_SHAPES = {"gpt-oss small lm_head 32768x768": (32768, 768), "SmolLM2 lm_head 49152x576": (49152, 576),
                "projection 2048x2048": (2048, 2048)}
ROWS_SHAPES = {"gpt-oss large q/k/v 3072x2048": (3072, 2048), "gpt-oss large o_proj 2048x2048": (2048, 2048)}
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
    from localmoe.quant.mxfp4 import dequantize

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
    from localmoe.kernels import _cpu
    from localmoe.kernels.mxfp4_moe import GEMV_MAX_TOKENS, cpu, mxfp4_linear

    if cpu.library() is None:
        print("CPU kernel unavailable: only the reference would run; nothing to compare")
        return
    threads = torch.get_num_threads()
    buffer = torch.ones((1 << 28) // 4)  # 256 MiB, far above any last-level cache
    out = torch.empty_like(buffer)
    print(f"CPU, {threads} threads, {_cpu.isa()} kernels: MXFP4 GEMV bytes/s over memory bandwidth (same run, goal "
          f">= {GOAL} at N=1), speed over torch; exact and q8 activations (the engine's default expert precision)")
    at_one = {"exact": [], "q8": []}
    for name, (O, K) in SHAPES.items():
        mats = _random_mxfp4(O, K, 4 if quick else 12)  # 12 x ~6 MB: well above a 32 MB L3
        nbytes = sum(p.nbytes + s.nbytes for p, s in mats)
        rows = []
        for N in (1, 4, 8):
            x = torch.randn(N, K)
            for precision in ("exact", "q8"):
                ratios, speeds, over_torch = [], [], []
                p, s = mats[0]
                linear = functools.partial(mxfp4_linear, precision=precision)
                for _ in range(rounds):  # interleaved, so that all three see the same (shared) machine
                    bw = _bandwidth(buffer, out)
                    t_kernel = _best(_each, 3, linear, x, mats)
                    ratios.append(nbytes / t_kernel / bw)
                    speeds.append((nbytes / t_kernel, bw))
                    over_torch.append(_best(_torch_path, 1, x, p, s) / _best(linear, 3, x, p, s))
                got, bw = max(speeds)
                if N == 1:
                    at_one[precision].append(statistics.median(ratios))
                rows.append((f"{name} N={N} {precision}",
                             (f"{got / 1e9:6.2f} GB/s over {bw / 1e9:5.2f} GB/s: median {statistics.median(ratios):.2f}, "
                              f"best {max(ratios):.2f}; {statistics.median(over_torch):5.1f}x dequantise+matmul (median)")))
        report(rows)
    print(f"N=1 over memory bandwidth, median of the shapes' medians (goal >= {GOAL}): "
          + ", ".join(f"{precision} {statistics.median(r):.2f}" for precision, r in at_one.items()))
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


def _per_expert_path(x, ids, weights, table, out):
    """What the engine ran before the layer kernel: per expert, three dispatcher GEMVs, the GLU in
    torch and a weighted index_add (the reference loop over `mxfp4_linear`)."""
    from localmoe.kernels.mxfp4_moe import mxfp4_linear, naive_mxfp4_moe

    return naive_mxfp4_moe(x, ids, weights, table.experts, "gpt_oss", (7.0, 1.702), out, linear=mxfp4_linear)


def moe_layer_bench(rounds: int, quick: bool) -> None:
    """One gpt-oss-sized MoE layer step (top-4 of 16 experts of 2880 x 2880, one token) through the
    fused layer kernel, q8 and exact expert precision: chosen expert bytes/s over memory bandwidth,
    speed over the per-expert path (exact, as the engine ran it before the fused kernel)."""
    from types import SimpleNamespace

    from localmoe.kernels.mxfp4_moe import ExpertTable, cpu, mxfp4_moe

    if cpu.library() is None:
        return
    E, D, k = 8 if quick else 16, 2880, 4
    mats = iter(_random_mxfp4(D, D, 3 * E))  # 16 x 3 x 4.4 MB: well above the last-level cache
    experts = {e: SimpleNamespace(**{p: SimpleNamespace(packed=pk, scales=sc, bias=torch.randn(D))
                                     for p, (pk, sc) in zip(("gate", "up", "down"), (next(mats) for _ in range(3)))})
               for e in range(E)}
    table = ExpertTable(experts, E)
    per_expert = sum(p.packed.nbytes + p.scales.nbytes for p in (experts[0].gate, experts[0].up, experts[0].down))
    routes = [torch.randperm(E)[:k].view(1, k) for _ in range(E)]  # every call reads other experts
    x, w, out = torch.randn(1, D), torch.rand(1, k), torch.zeros(1, D)
    buffer = torch.ones((1 << 28) // 4)
    copy = torch.empty_like(buffer)

    def sweep(fn):
        for ids in routes:
            fn(x, ids, w, table, out)

    def layer(precision):
        def fused(x, ids, w, table, out):
            return mxfp4_moe(x, ids, w, table, "gpt_oss", (7.0, 1.702), out, precision=precision)
        return fused

    print(f"CPU, {torch.get_num_threads()} threads: fused MoE layer (top-{k} of {E} experts 2880x2880, gpt-oss GLU, "
          "one token) chosen-expert bytes/s over memory bandwidth, speed over the per-expert path")
    rows = []
    for precision in ("q8", "exact"):
        ratios, over, speeds = [], [], []
        for _ in range(rounds):  # interleaved, so that all see the same (shared) machine
            bw = _bandwidth(buffer, copy)
            t_fused = _best(sweep, 3, layer(precision))
            ratios.append(len(routes) * k * per_expert / t_fused / bw)
            speeds.append((len(routes) * k * per_expert / t_fused, bw))
            over.append(_best(sweep, 2, _per_expert_path) / t_fused)
        got, bw = max(speeds)
        shown = (f"{got / 1e9:6.2f} GB/s over {bw / 1e9:5.2f} GB/s: median {statistics.median(ratios):.2f}, "
                 f"best {max(ratios):.2f}; {statistics.median(over):4.2f}x per-expert path (median)")
        rows.append((f"moe layer N=1 {precision}", shown))
    report(rows)


def _torch_linear(x, w):
    return F.linear(x.to(w.dtype), w)


def _each_dense(fn, x, mats) -> None:
    for w in mats:
        fn(x, w)


def dense_bench(rounds: int, quick: bool) -> None:
    from localmoe.kernels.dense_gemv import dense_gemv, kernel_available

    if not kernel_available():
        print("Dense GEMV: CPU kernel unavailable; nothing to compare")
        return
    buffer = torch.ones((1 << 28) // 4)
    out = torch.empty_like(buffer)
    print(f"CPU, {torch.get_num_threads()} threads: dense GEMV bytes/s over memory bandwidth (same run), "
          "speed over torch F.linear (medians)")
    for dtype in (torch.float32, torch.bfloat16):
        rows = []
        for name, (O, K) in DENSE_SHAPES.items():
            count = max(2, (128 if quick else 256) * 2**20 // (O * K * dtype.itemsize))  # well above the LLC
            mats = [torch.randn(O, K).to(dtype) for _ in range(count)]
            nbytes = sum(w.nbytes for w in mats)
            for N in (1, 2, 4, 8):
                x = torch.randn(N, K)
                ratios, over_torch, speeds = [], [], []
                for _ in range(rounds):  # interleaved, so that all see the same (shared) machine
                    bw = _bandwidth(buffer, out)
                    t_kernel = _best(_each_dense, 2, dense_gemv, x, mats)
                    t_torch = _best(_each_dense, 2, _torch_linear, x, mats)
                    ratios.append(nbytes / t_kernel / bw)
                    speeds.append((nbytes / t_kernel, bw))
                    over_torch.append(t_torch / t_kernel)
                got, bw = max(speeds)
                rows.append((f"{str(dtype)[6:]} {name} N={N}",
                             (f"{got / 1e9:6.2f} GB/s over {bw / 1e9:5.2f} GB/s: median {statistics.median(ratios):.2f}, "
                             f"best {max(ratios):.2f}; {statistics.median(over_torch):4.2f}x F.linear")))
        report(rows)
    dense_rows_bench(rounds)


def dense_rows_bench(rounds: int) -> None:
    """A batched step's rows (N = 16, 64: the multi-row kernel's register tiles) on the attention matrices of
    gpt-oss `large`: GFLOP/s of `dense_gemv` and its time over torch's sgemm on an fp32 copy (the peer: the
    fastest GEMM here; bf16 F.linear is far slower on CPUs without AMX). Hot weights: at 16+ rows compute bounds
    the call, not the weight's read."""
    from localmoe.kernels.dense_gemv import dense_gemv

    print(f"CPU, {torch.get_num_threads()} threads: dense multi-row GEMV GFLOP/s and speed over torch's fp32 sgemm "
          "(medians)")
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (O, K) in ROWS_SHAPES.items():
            w = torch.randn(O, K).to(dtype)
            wide = w.float()
            for N in (16, 64):
                x = torch.randn(N, K)
                kernel, sgemm = [], []
                for _ in range(rounds):  # interleaved
                    kernel.append(_best(dense_gemv, 3, x, w))
                    sgemm.append(_best(F.linear, 3, x, wide))
                flops = 2 * N * O * K
                rows.append((f"{str(dtype)[6:]} {name} N={N}",
                             f"{flops / statistics.median(kernel) / 1e9:6.1f} GFLOP/s, sgemm "
                             f"{flops / statistics.median(sgemm) / 1e9:6.1f}: "
                             f"{statistics.median(s / k for s, k in zip(sgemm, kernel)):4.2f}x sgemm"))
    report(rows)


def ggml_bench(rounds: int, quick: bool) -> None:
    import gguf
    import numpy as np
    from localmoe.kernels.dense_gemv import dense_gemv
    from localmoe.kernels.ggml_gemv import K_QUANTS, TYPES, ggml_gemv, kernel_available

    from localmoe.quant.ggml import dequantize
    from localmoe.testing.ggml_blocks import random_blocks

    if not kernel_available():
        print("GGUF block GEMV: CPU kernel unavailable; nothing to compare")
        return
    O = K = 4096
    buffer = torch.ones((1 << 28) // 4)
    out = torch.empty_like(buffer)
    rng = np.random.default_rng(0)
    print(f"CPU, {torch.get_num_threads()} threads: GGUF block GEMV {O}x{K}, block bytes/s over memory bandwidth "
          "(same run), speed over the GEMV of a bf16 copy (medians)")
    rows = []
    for kind in TYPES:
        one = (torch.from_numpy(random_blocks(kind, O, K, rng)) if kind in K_QUANTS else
               torch.from_numpy(gguf.quants.quantize(rng.standard_normal((O, K)).astype(np.float32) * 0.05, kind)))
        count = max(2, (128 if quick else 256) * 2**20 // one.nbytes)  # well above the LLC
        mats = [one.clone() for _ in range(count)]
        copies = [dequantize(one, kind, (O, K), torch.bfloat16) for _ in range(max(2, count // 4))]
        nbytes, copy_bytes = sum(m.nbytes for m in mats), sum(c.nbytes for c in copies)
        for N in (1, 4):
            x = torch.randn(N, K)
            ratios, over_copy, speeds = [], [], []
            for _ in range(rounds):
                bw = _bandwidth(buffer, out)
                t_blocks = _best(lambda x=x, kind=kind, mats=mats: [ggml_gemv(x, m, kind, (O, K)) for m in mats],
                                 2) / len(mats)
                t_copy = _best(lambda x=x, copies=copies: [dense_gemv(x, c) for c in copies], 2) / len(copies)
                ratios.append(nbytes / len(mats) / t_blocks / bw)
                speeds.append((nbytes / len(mats) / t_blocks, bw))
                over_copy.append(t_copy / t_blocks)
            got, bw = max(speeds)
            rows.append((f"{kind.name} N={N}", (f"{got / 1e9:6.2f} GB/s over {bw / 1e9:5.2f} GB/s: median "
                                                f"{statistics.median(ratios):.2f}, best {max(ratios):.2f}; "
                                                f"{statistics.median(over_copy):4.2f}x the bf16 copy "
                                                f"({copy_bytes / len(copies) / 2**20:.0f} vs "
                                                f"{nbytes / len(mats) / 2**20:.1f} MiB)")))
    report(rows)


def gpu_bench() -> None:
    """The GPU section: benchmarks/gpu_kernels.py (skipped without CUDA and Triton)."""
    from gpu_kernels import run

    run()


E2E_DENSE = {"f32": ("float32", "gpt_oss_small.gguf"), "bf16": ("bfloat16", "gpt_oss_small_bf16.gguf")}


def _e2e_child(kind: str, src: Path, gguf_path: Path, threads: int, tokens: int, dtype: str) -> dict:
    """Prefill of E2E_PREFILL tokens (after a 512-token warm-up), then greedy decode of `tokens` tokens
    after E2E_PROMPT and 3 untimed steps, in this process."""
    long_prompt = [(i * 7919) % 30000 + 17 for i in range(E2E_PREFILL)]
    if kind == "localmoe":
        from localmoe.config import EngineConfig
        from localmoe.engine.generate import prefill
        from localmoe.load import load_model

        model = load_model(src, EngineConfig(dtype=dtype, threads=threads), progress=False).model

        def prefilled(ids: list[int]) -> None:
            with torch.no_grad():
                prefill(model, ids, model.new_cache(1, len(ids) + 8))  # in PREFILL_CHUNK chunks, as served

        cache = model.new_cache(1, len(E2E_PROMPT) + tokens + 8)

        def step(ids: list[int]) -> int:
            with torch.no_grad():
                return int(model.forward(torch.tensor([ids]), cache)[0, -1].argmax())
    else:
        import numpy as np
        from llama_cpp import Llama, llama_get_logits_ith

        llm = Llama(model_path=str(gguf_path), n_ctx=E2E_PREFILL + 64, n_threads=threads, n_threads_batch=threads,
                    n_gpu_layers=0, verbose=False)  # n_batch 512: prompts in 512-token batches, as ours
        vocab = llm.n_vocab()

        def prefilled(ids: list[int]) -> None:
            llm.reset()
            llm.eval(ids)

        def step(ids: list[int]) -> int:
            llm.eval(ids)
            return int(np.argmax(np.ctypeslib.as_array(llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))))
    prefilled(long_prompt[:512])
    start = time.perf_counter()
    prefilled(long_prompt)
    prefill_tok_s = E2E_PREFILL / (time.perf_counter() - start)
    if kind == "llama":
        llm.reset()
    out = [step(E2E_PROMPT)]
    for _ in range(3):
        out.append(step([out[-1]]))
    start = time.perf_counter()
    for _ in range(tokens):
        out.append(step([out[-1]]))
    return {"tok_s": tokens / (time.perf_counter() - start), "prefill_tok_s": prefill_tok_s, "tokens": out}


def e2e_bench(work: Path, threads: int, tokens: int, repeats: int, dense: str) -> None:
    from localmoe.testing import write_checkpoint
    from localmoe.testing.gpt_oss_gguf import write_gguf

    src, gguf_path = work / "gpt_oss_small", work / E2E_DENSE[dense][1]
    if not (src / "config.json").exists():
        src.mkdir(parents=True, exist_ok=True)
        write_checkpoint("gpt_oss", src, "small", seed=0)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        llama = "not installed (pip install llama-cpp-python to compare)"
    else:
        llama = None
        if not gguf_path.exists():
            write_gguf(src, gguf_path, dense=dense)
    runs: dict[str, list[dict]] = {"localmoe": [], "llama": []}
    for _ in range(repeats):  # alternate the engines so both see the same (shared) machine
        for kind in ("localmoe",) + (("llama",) if llama is None else ()):
            cmd = [sys.executable, __file__, "--e2e-child", kind, "--work", str(work), "--threads", str(threads),
                   "--tokens", str(tokens), "--e2e-dense", dense]
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
            runs[kind].append(json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0
                              else {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:]})
    results = {}
    for kind, rs in runs.items():
        ok = [r for r in rs if "tok_s" in r]
        if ok:
            speeds, prefills = sorted(r["tok_s"] for r in ok), sorted(r["prefill_tok_s"] for r in ok)
            results[kind] = {"tok_s": speeds[-1], "median": statistics.median(speeds), "tokens": ok[0]["tokens"],
                             "prefill": prefills[-1], "prefill_median": statistics.median(prefills)}
        elif rs:
            results[kind] = rs[0]
    print(f"End to end, gpt_oss small (8 layers, 16 experts, top-4, hidden 768), dense weights {dense} on both "
          f"sides, {threads} threads, {tokens} greedy decode tokens:")
    def shown(r: dict) -> str:
        return (f"{r['tok_s']:7.1f} tok/s best of {repeats} (median {r['median']:.1f}); prefill of {E2E_PREFILL} "
                f"tokens {r['prefill']:.0f} tok/s (median {r['prefill_median']:.0f})" if "tok_s" in r
                else f"failed: {r['error']}")

    rows = [("localmoe", shown(results["localmoe"])), ("llama.cpp", llama or shown(results["llama"]))]
    if llama is None and all("tok_s" in r for r in results.values()):
        ours, peer = results["localmoe"], results["llama"]
        same = next((i for i, (a, b) in enumerate(zip(ours["tokens"], peer["tokens"])) if a != b), len(ours["tokens"]))
        rows.append(("RATIO localmoe / llama.cpp", (f"{ours['tok_s'] / peer['tok_s']:.2f}x best, "
                                                   f"{ours['median'] / peer['median']:.2f}x median (goal >= 1.0); "
                                                   f"greedy tokens agree for the first {same} of {len(ours['tokens'])}")))
        rows.append((f"RATIO prefill {E2E_PREFILL} tokens", (f"{ours['prefill'] / peer['prefill']:.2f}x best, "
                                                           f"{ours['prefill_median'] / peer['prefill_median']:.2f}x "
                                                           "median")))
    report(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--e2e", action="store_true", help="also decode tokens/s against llama.cpp (gpt_oss small)")
    ap.add_argument("--no-kernels", action="store_true", help="skip the kernel sections (with --e2e)")
    ap.add_argument("--dense-only", action="store_true", help="only the dense GEMV section (and --e2e)")
    ap.add_argument("--moe-only", action="store_true", help="only the fused MoE layer section (and --e2e)")
    ap.add_argument("--ggml-only", action="store_true", help="only the GGUF block GEMV section (and --e2e)")
    ap.add_argument("--gpu-only", action="store_true", help="only the GPU section (benchmarks/gpu_check.sh)")
    cache = Path(os.environ.get("LOCALMOE_CACHE", Path.home() / ".cache" / "localmoe"))
    ap.add_argument("--work", type=Path, default=cache / "bench", help="where --e2e keeps its checkpoints")
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed by --e2e")
    ap.add_argument("--e2e-child", choices=["localmoe", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--e2e-dense", choices=list(E2E_DENSE), action="append",
                    help="dense weight dtype of the --e2e comparison (repeatable; default: both)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    if args.e2e_child:
        dtype, gguf_name = E2E_DENSE[args.e2e_dense[0]]
        print(json.dumps(_e2e_child(args.e2e_child, args.work / "gpt_oss_small", args.work / gguf_name, threads,
                                    args.tokens, dtype)))
        return
    if args.dense_only:
        dense_bench(args.rounds, args.quick)
    elif args.moe_only:
        moe_layer_bench(args.rounds, args.quick)
    elif args.ggml_only:
        ggml_bench(args.rounds, args.quick)
    elif args.gpu_only:
        gpu_bench()
    elif not args.no_kernels:
        cpu_bench(args.rounds, args.quick)
        moe_layer_bench(args.rounds, args.quick)
        dense_bench(args.rounds, args.quick)
        ggml_bench(args.rounds, args.quick)
        gpu_bench()
    if args.e2e:
        for dense in args.e2e_dense or list(E2E_DENSE):
            e2e_bench(args.work, threads, args.tokens, args.rounds, dense)


if __name__ == "__main__":
    main()
