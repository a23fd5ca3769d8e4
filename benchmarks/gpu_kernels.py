"""The GPU kernel figures of benchmarks/gpu_check.sh, each a ratio against a limit or a peer, ending in a
SUMMARY block with every figure beside its goal (issue 22).

- Copy bandwidth: a 1 GiB device-to-device copy (read + write bytes), the limit the GEMV is held to.
- MXFP4 grouped GEMV, 32 experts of K3's and gpt-oss's shapes, N = 1, 4, 16 rows per expert (M = 32 N):
  codes + scales bytes / time over the copy bandwidth, (a) the kernel alone (tile tables built before),
  (b) the engine's call path `localmoe.kernels.mxfp4_moe.mxfp4_grouped` (tables on the device, the
  kernel, split-K sum) in a CUDA graph (how the decode step runs) and (c) eagerly; beside it torch's
  bf16 `bmm` over the same experts (4x the bytes) with absolute times, and a small sweep of tile sizes
  at N = 1 (what to tune next).
- KDA and Gated DeltaNet, B = 1, H = 32, K = V = 128: chunk prefill at T = 4096 and recurrent decode at
  T = 1, tokens/s of the dispatcher (fla where it imports), of fla called directly and of our own Triton
  kernels; the recurrent step's microseconds per layer, in a CUDA graph and eagerly.

Times are the best of 5 rounds; each round replays a CUDA graph of `reps` calls (or calls eagerly) between
two CUDA events. `--smoke` runs the same code on tiny shapes on the CPU (Triton interpreter), to check the
script, not to measure anything.

    python benchmarks/gpu_kernels.py [--smoke]
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

GEMV_SHAPES = {"K3 gate/up": (3072, 3584), "K3 down": (3584, 3072), "gpt-oss": (2880, 2880)}  # (O, K) per expert
SMOKE_GEMV_SHAPES = {"smoke": (64, 96)}
EXPERTS = 32
ROWS = (1, 4, 16)
SWEEP = [{"BLOCK_O": o, "BLOCK_K": k, "SPLIT_K": s, "num_warps": w} for o, k, s, w in
         [(32, 256, 1, 4), (16, 256, 1, 4), (64, 256, 1, 8), (32, 512, 1, 4), (16, 512, 1, 4), (32, 256, 1, 8),
          (32, 256, 2, 4), (64, 128, 1, 4), (32, 256, 1, 2)]]
GOALS = {"gemv_kernel": 0.8, "gemv_path": 0.7, "chunk_over_fla": 1.2, "fla_chunk": 3e6, "recurrent_us": 15.0}


@dataclass
class Summary:
    """(figure, value shown, goal shown, met or None) rows printed at the end."""
    rows: list = field(default_factory=list)

    def add(self, name: str, shown: str, goal: str = "", met: bool | None = None) -> None:
        self.rows.append((name, shown, goal, met))

    def print(self) -> None:
        print("\n== SUMMARY (issue 22 goals; 'ok' / 'MISSED' where a goal applies)")
        width = max((len(r[0]) for r in self.rows), default=0)
        for name, shown, goal, met in self.rows:
            mark = "" if met is None else ("ok" if met else "MISSED")
            print(f"  {name:<{width}}  {shown}{f'  ({goal})' if goal else ''}  {mark}".rstrip())


class Clock:
    """Best seconds per call of fn(): CUDA events around a graph replay (or eager calls) on CUDA,
    perf_counter on the CPU."""

    def __init__(self, device: str, rounds: int = 5):
        self.cuda, self.rounds = device == "cuda", rounds

    def __call__(self, fn, *args, graph: bool = True, budget_s: float = 0.25) -> tuple[float, str]:
        """(seconds per call of fn(*args), "graph" or "eager ...")."""
        fn = functools.partial(fn, *args)
        fn()  # compile, warm up
        self.sync()
        start = time.perf_counter()
        fn()
        self.sync()
        once = max(time.perf_counter() - start, 1e-6)
        rounds = self.rounds
        reps = max(1, min(20, int(budget_s / rounds / once)))
        run, how = (lambda: [fn() for _ in range(reps)]), "eager"
        if graph and self.cuda:
            try:
                run, how = self._graph(fn, reps), "graph"
            except Exception as exc:  # noqa: BLE001 - report and time eagerly
                how = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:80]})"
        best = float("inf")
        for _ in range(rounds):
            if self.cuda:
                t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0.record()
                run()
                t1.record()
                t1.synchronize()
                best = min(best, t0.elapsed_time(t1) / 1e3 / reps)
            else:
                t = time.perf_counter()
                run()
                best = min(best, (time.perf_counter() - t) / reps)
        return best, how

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    @staticmethod
    def _graph(fn, reps: int):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(reps):
                fn()
        return graph.replay


def copy_bandwidth(clock: Clock, device: str, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t, _ = clock(dst.copy_, src, graph=False, budget_s=0.5)
    return 2 * nbytes / t


def _experts(O: int, K: int, E: int, device: str):
    """E random MXFP4 experts (codes anything, scales around 2^-6) and their bf16 dequantisation."""
    from localmoe.quant.mxfp4 import dequantize

    g = torch.Generator().manual_seed(O + K)
    packed = torch.randint(0, 256, (E, O, K // 2), dtype=torch.uint8, generator=g).to(device)
    scales = torch.randint(118, 124, (E, O, K // 32), dtype=torch.uint8, generator=g).to(device)
    dense = torch.stack([dequantize(packed[e], scales[e], torch.bfloat16) for e in range(E)])
    return packed, scales, dense


def gemv_bench(clock: Clock, device: str, bw: float, shapes: dict, E: int, summary: Summary) -> None:
    """Per shape and N: the GEMV kernel alone (forced at every N, tile tables built before), tl.dot tiles
    (forced, with their tables), the dispatcher (`mxfp4_grouped`: it picks one by shape) in a CUDA graph
    and eagerly, and torch's bf16 bmm."""
    from localmoe.kernels import mxfp4_moe
    from localmoe.kernels.mxfp4_moe import triton as tk
    from localmoe.kernels.mxfp4_moe.triton_tiles import plan

    print(f"\n== MXFP4 grouped matmul, {E} experts, N rows per expert (M = {E} N), bf16 x (fp32 on the CPU); "
          f"bytes/s over copy bandwidth {bw / 1e9:,.0f} GB/s; the dispatcher takes the GEMV up to "
          f"{tk.GEMV_MAX_ROWS} rows per expert, tl.dot tiles above")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter has no bf16
    worst, hows = {}, set()
    for name, (O, K) in shapes.items():
        packed, scales, dense = _experts(O, K, E, device)
        nbytes = packed.nbytes + scales.nbytes
        for N in ROWS:
            M = E * N
            x = torch.randn(M, K, device=device, dtype=dtype)
            ids = torch.arange(E, device=device).repeat_interleave(N)
            cfg = tk.gemv_config(M, E, O, K, max_rows=16)
            tables, y = plan(ids, E, cfg["BLOCK_N"]), x.new_empty(M, O)
            t_gemv, _ = clock(tk.gemv, x, packed, scales, None, tables, cfg, y)
            t_dot, _ = clock(tk.mxfp4_grouped, x, packed, scales, ids, None, "dot")
            t_path, how = clock(mxfp4_moe.mxfp4_grouped, x, packed, scales, ids)
            t_eager, _ = clock(mxfp4_moe.mxfp4_grouped, x, packed, scales, ids, graph=False)
            xb = x.view(E, N, K)
            t_bmm, _ = clock(torch.bmm, xb.to(torch.bfloat16), dense.transpose(1, 2))
            got = mxfp4_moe.mxfp4_grouped(x, packed, scales, ids).float()
            want = torch.bmm(xb.float(), dense.float().transpose(1, 2)).reshape(M, O)
            err = ((got - want).norm() / want.norm()).item()
            hows.add(how)
            ratio = {key: nbytes / t / bw for key, t in (("gemv", t_gemv), ("dot", t_dot), ("path", t_path),
                                                            ("eager", t_eager))}
            picked = "GEMV" if tk.gemv_config(M, E, O, K) else "tl.dot"
            print(f"  {name} {O}x{K} N={N:<2}: GEMV alone {t_gemv * 1e6:7.1f} us = {ratio['gemv']:.2f} of copy bw "
                  f"({cfg}); tl.dot tiles {t_dot * 1e6:7.1f} us = {ratio['dot']:.2f}; dispatcher ({picked}) "
                  f"{t_path * 1e6:7.1f} us = {ratio['path']:.2f} ({how}), eager {t_eager * 1e6:7.1f} us = "
                  f"{ratio['eager']:.2f}; bf16 bmm {t_bmm * 1e6:7.1f} us = {dense.nbytes / t_bmm / bw:.2f} of copy "
                  f"bw (4x the bytes); dispatcher / bmm time {t_path / t_bmm:.2f}; rel. error vs bmm {err:.1e}")
            for key, value in ratio.items():
                worst[key, N] = min(worst.get((key, N), 9.9), value)
            worst["time", N] = max(worst.get(("time", N), 0.0), t_path / t_bmm)
            worst["gemv/dot", N] = max(worst.get(("gemv/dot", N), 0.0), t_gemv / t_dot)
    captured = "graph" if hows == {"graph"} else "NOT captured: see above"
    for N in ROWS:
        at_1 = N == 1
        summary.add(f"MXFP4 N={N} GEMV kernel alone, worst shape", f"{worst['gemv', N]:.2f} of copy bw",
                    f"goal >= {GOALS['gemv_kernel']}" if at_1 else "", worst["gemv", N] >= GOALS["gemv_kernel"] if at_1
                    else None)
        summary.add(f"MXFP4 N={N} engine call path ({captured}), worst", f"{worst['path', N]:.2f} of copy bw",
                    f"goal >= {GOALS['gemv_path']}" if at_1 else "", worst["path", N] >= GOALS["gemv_path"] if at_1
                    else None)
        summary.add(f"MXFP4 N={N} engine call path (eager), worst", f"{worst['eager', N]:.2f} of copy bw")
        summary.add(f"MXFP4 N={N} call path time over bf16 bmm, worst", f"{worst['time', N]:.2f}x", "goal < 1.0",
                    worst["time", N] < 1.0)
        summary.add(f"MXFP4 N={N} GEMV time over tl.dot tiles, worst", f"{worst['gemv/dot', N]:.2f}x",
                    f"GEMV_MAX_ROWS = {tk.GEMV_MAX_ROWS}: below 1 expected up to it, above 1 past it")


SWEEP_16 = [{"BLOCK_O": o, "BLOCK_K": k, "SPLIT_K": 1, "num_warps": w} for o, k, w in
            [(32, 128, 4), (16, 128, 4), (32, 256, 4), (16, 256, 8), (32, 128, 8)]]


def gemv_sweep(clock: Clock, device: str, bw: float, shapes: dict, E: int, summary: Summary) -> None:
    """N = 1 and 16 on the first shape with other tile sizes than gemv_config's: where to tune."""
    import triton
    from localmoe.kernels.mxfp4_moe import triton as tk
    from localmoe.kernels.mxfp4_moe.triton_tiles import plan

    name, (O, K) = next(iter(shapes.items()))
    packed, scales, _ = _experts(O, K, E, device)
    for N, configs in ((1, SWEEP), (16, SWEEP_16)):
        x = torch.randn(E * N, K, device=device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
        tables, y = plan(torch.arange(E, device=device).repeat_interleave(N), E, N), x.new_empty(E * N, O)
        print(f"\n== GEMV tile sweep, {name} {O}x{K}, N={N} (kernel alone; default "
              f"{tk.gemv_config(E * N, E, O, K, max_rows=16)})")
        best = (0.0, None)
        for cfg in configs if device == "cuda" else configs[:2]:
            cfg = dict(cfg, BLOCK_N=N, BLOCK_K=min(cfg["BLOCK_K"], triton.next_power_of_2(K)))
            if device != "cuda":
                cfg.pop("num_warps")
            t, _ = clock(tk.gemv, x, packed, scales, None, tables, cfg, y)
            ratio = (packed.nbytes + scales.nbytes) / t / bw
            print(f"  {cfg}: {t * 1e6:7.1f} us = {ratio:.2f} of copy bw")
            best = max(best, (ratio, cfg), key=lambda b: b[0])
        summary.add(f"GEMV N={N} best swept tile (kernel alone)", f"{best[0]:.2f} of copy bw with {best[1]}")


def _reference_as_fla(op: str, q, k, v, g, beta, state):
    from localmoe.kernels.gated_delta.reference import naive_recurrent_gated_delta
    from localmoe.kernels.kda.reference import naive_recurrent_kda

    return (naive_recurrent_gated_delta if "gated_delta" in op else naive_recurrent_kda)(q, k, v, g, beta, state)


def delta_bench(clock: Clock, device: str, T_chunk: int, H: int, K: int, summary: Summary, smoke: bool) -> None:
    from localmoe.kernels import gated_delta as gdn
    from localmoe.kernels import kda
    from localmoe.kernels.gated_delta import triton as gdn_triton
    from localmoe.kernels.kda import fla_ops
    from localmoe.kernels.kda import triton as kda_triton

    if smoke:  # fla's chunk kernels need a GPU: its figures come from a stand-in, to run the code around them
        fla, fla_run, about = True, _reference_as_fla, "smoke stand-in (the reference)"
    else:
        fla, fla_run = fla_ops.ops() is not None, fla_ops.run
        about = f"fla-core {__import__('fla').__version__}" if fla else "not available (our Triton only)"
    print(f"\n== KDA / Gated DeltaNet, B=1, H={H}, K=V={K}, fp32 inputs (the engine's); fla: {about}")
    for kind in ("kda", "gdn"):
        dispatch = kda.kda if kind == "kda" else gdn.gated_delta
        ours = {"chunk": kda_triton.chunk_kda if kind == "kda" else gdn_triton.chunk_gated_delta,
                "recurrent": kda_triton.fused_recurrent_kda if kind == "kda" else gdn_triton.fused_recurrent_gated_delta}
        for form, T in (("chunk", T_chunk), ("recurrent", 1)):
            g_ = torch.Generator().manual_seed(T)
            q = F.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1).to(device) * K ** -0.5
            k = F.normalize(torch.randn(1, T, H, K, generator=g_), dim=-1).to(device)
            v = torch.randn(1, T, H, K, generator=g_).to(device)
            g = (-torch.rand(1, T, H, *((K,) if kind == "kda" else ()), generator=g_) * 0.1).to(device)
            beta = torch.rand(1, T, H, generator=g_).to(device)
            state = torch.zeros(1, H, K, K, device=device)
            args = (q, k, v, g, beta, state)
            graph = form == "recurrent"
            op = {("kda", "chunk"): "chunk_kda", ("kda", "recurrent"): "fused_recurrent_kda",
                  ("gdn", "chunk"): "chunk_gated_delta_rule", ("gdn", "recurrent"): "fused_recurrent_gated_delta_rule"}
            timed = {"dispatcher": clock(dispatch, *args, graph=graph), "ours": clock(ours[form], *args, graph=graph)}
            if fla:
                bf = [t.bfloat16() for t in args[:5]]
                timed["fla"] = clock(fla_run, op[kind, form], *args, graph=graph)
                timed["fla bf16"] = clock(fla_run, op[kind, form], *bf, state, graph=graph)
            times = {who: t for who, (t, _) in timed.items()}
            how = {how for _, how in timed.values()}
            shown = ", ".join(f"{who} {T / t:,.0f} tok/s ({t * 1e6:,.1f} us)" for who, t in times.items())
            print(f"  {kind} {form} T={T} ({', '.join(sorted(how))}): {shown}")
            if form == "chunk":
                if fla:
                    ratio = times["dispatcher"] / times["fla"]
                    summary.add(f"{kind} chunk T={T} dispatcher time over fla's", f"{ratio:.2f}x",
                                f"goal <= {GOALS['chunk_over_fla']}", ratio <= GOALS["chunk_over_fla"])
                    summary.add(f"{kind} chunk T={T} fla itself", f"{T / times['fla']:,.0f} tok/s fp32, "
                                f"{T / times['fla bf16']:,.0f} bf16", "measured before: >= 3 M",
                                T / times["fla bf16"] >= GOALS["fla_chunk"])
                    summary.add(f"{kind} chunk T={T} our Triton over fla (fallback)",
                                f"{times['ours'] / times['fla']:.1f}x the time")
                else:
                    summary.add(f"{kind} chunk T={T} (no fla: our Triton)", f"{T / times['ours']:,.0f} tok/s")
            else:
                us = times["dispatcher"] * 1e6
                summary.add(f"{kind} recurrent T=1 per layer (dispatcher, {timed['dispatcher'][1]})", f"{us:.1f} us",
                            f"goal <= {GOALS['recurrent_us']:.0f} us", us <= GOALS["recurrent_us"])


def run(smoke: bool = False) -> None:
    """Every section, then the summary; `smoke`: tiny shapes on the CPU through the Triton interpreter
    (set TRITON_INTERPRET=1 before triton is imported)."""
    from localmoe.kernels._triton import HAVE_TRITON

    device = "cuda" if torch.cuda.is_available() and not smoke else "cpu"
    if not HAVE_TRITON or (device == "cpu" and not smoke):
        print("GPU: skipped (needs CUDA and triton)")
        return
    clock, summary = Clock(device, rounds=5 if device == "cuda" else 1), Summary()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped by a timeout: the summary holds what was measured"))
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        print(f"GPU {props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB; "
              f"torch {torch.__version__}, triton {__import__('triton').__version__}")
    bw = copy_bandwidth(clock, device, (1 << 30) if device == "cuda" else (1 << 24))
    summary.add("copy bandwidth (read + write)", f"{bw / 1e9:,.0f} GB/s")
    shapes, E = (GEMV_SHAPES, EXPERTS) if device == "cuda" else (SMOKE_GEMV_SHAPES, 4)
    sections = [("GEMV", lambda: gemv_bench(clock, device, bw, shapes, E, summary)),
                ("KDA / GDN", lambda: delta_bench(clock, device, *((4096, 32, 128) if device == "cuda" else
                                                                   (80, 2, 16)), summary, smoke)),
                ("GEMV sweep", lambda: gemv_sweep(clock, device, bw, shapes, E, summary))]
    try:
        for name, section in sections:
            start = time.perf_counter()
            try:
                section()
            except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others' figures
                summary.add(f"{name} section", f"FAILED: {type(exc).__name__}: {exc}", "", False)
                traceback.print_exc(file=sys.stdout)
            print(f"  ({name}: {time.perf_counter() - start:.0f} s)")
    finally:
        summary.print()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter): checks the script")
    args = ap.parse_args()
    if args.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    run(args.smoke)


if __name__ == "__main__":
    main()
