"""MoE GGUFs quantised by llama.cpp itself: localmoe against llama.cpp on the SAME file.

Each model is a generated random checkpoint (`localmoe.testing`, real layout) converted to an F32 GGUF by
llama.cpp's own `convert_hf_to_gguf.py` (benchmarks/k3_cpu.py fetches it), then quantised by llama.cpp's own
quantiser (llama-cpp-python's `llama_model_quantize`, as decode_dense.py --quant does) to Q4_K_M: Q4_K with
Q6_K where llama-quantize gives more bits, routed experts included. Both engines run that one file, same
threads, greedy; localmoe keeps every block type as stored (`--dtype auto`) and computes the experts from
their blocks (expert precision q8: activations rounded to int8 per 32 values, per 256 for K-quant rows and the
Q6_K lm_head, as llama.cpp does). The engines
alternate in separate processes (benchmarks/alternate.py); printed per round and as medians: prefill and
decode tokens/s and localmoe / llama.cpp, the decode rates as fractions of the read roofline (weight bytes per
decode token over a plain read's bandwidth, measured between the rounds on the same clock and threads), and the
agreement of the logits at the prompt's last position (Pearson correlation, max |diff| over the range, same argmax).

    python benchmarks/gguf_moe.py [--models qwen3_moe:small,glm4_moe:small] [--quant q4_k_m] [--threads 2]
                                  [--pairs 4] [--prompt 72] [--decode 64] [--work DIR]
                                  [--paged 25%] [--writer llama.cpp|localmoe|requantised]

`--paged 25%`: instead, the equal-memory comparison. The GGUF is converted to a packed store (`localmoe convert`),
localmoe decodes it paged with a RAM budget of that share of the expert bytes (LFRU, O_DIRECT, prefetch) and
llama.cpp decodes the GGUF through its mmap, each in a cgroup v1 memory group with the SAME limit: localmoe's
footprint after loading (what the group is charged after the process joins it: dense weights and the slab; both
engines join before loading their model, after importing their modules) + slack, measured once by a first
localmoe run (benchmarks/offload.py's children; root only). The engines then alternate (`--pairs`), both files dropped from the
page cache before each run; printed: decode tokens/s of each, the ratio, the limit, each run's peak and how often
it hit the limit. Meaningful only when the experts are much larger than the interpreter (`large` sizes): a small
file fits in the limit whole. `--writer localmoe` writes the Q4_K_M file with localmoe's own GGUF writer
(localmoe.testing.moe_gguf: llama.cpp's layout and llama-quantize's Q4_K_M type mix, random blocks) instead of
llama.cpp's converter + quantiser, which take too long and too much disk for a `large` model on a small machine;
`--writer requantised` then has llama.cpp's own quantiser requantise that file to Q8_0 and that to `--quant`
(llama.cpp copies a tensor already of the target type unchanged: localmoe's Q4_K_M mix is llama-quantize's, tensor
for tensor), so both engines run blocks llama.cpp quantised.

K3 (`--models kimi_k3:small`): llama-quantize requantises its MXFP4 experts (Q5_0 / Q4_K), which localmoe runs from
those blocks.

Logits like for like: after the timed rounds the file's function is also computed without rounding. A twin of the file
whose quantised tensors are F32 values by gguf's numpy dequantiser (made once beside it, within --twin-limit GB) runs
in both engines on fp32 activations (localmoe `--expert-precision exact`; llama.cpp multiplies F32 matrices on fp32 x
and keeps an F32 KV cache), every prompt position, judged before the first router near-tie (benchmarks/k3_cpu.py
`agreement`); then each engine's logits on the quantised file are compared with llama.cpp's on the twin. Both engines
round activations to int8 on the file (per 256 for K-quant rows, llama.cpp's Q8_K; per 32 for the others), a
discontinuous step that a random K3 amplifies (chaotic under rounding: docs/performance.md), so on the file two correct
engines agree only as far as each stays from the unrounded function; the twin line is the like-for-like figure.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from alternate import alternate, median_ratio
from decode_dense import requantised
from k3_cpu import localmoe_worker, peer_benchmark, prepare, roofline


def compare(family: str, size: str, args, work: Path, src: Path) -> None:
    import time

    import numpy as np
    import torch
    from common import memory_read_bandwidth

    gguf = quantised(family, size, args, work, src)
    common = ["--threads", str(args.threads), "--prompt", str(args.prompt), "--decode", str(args.decode),
              *(["--cpu-time"] * args.cpu_time)]
    me = Path(__file__).resolve()
    logits = {name: work / f"{family}-{size}-{args.quant}-{name}.npy" for name in ("localmoe", "llama.cpp")}
    workers = {"localmoe": [str(me), "--worker", "localmoe", "--path", str(gguf), "--logits", str(logits["localmoe"]),
                            *common],
               "llama.cpp": [str(me), "--worker", "llama", "--path", str(gguf), "--logits", str(logits["llama.cpp"]),
                             *common]}

    def show(r: int, res: dict) -> None:
        ours, theirs = res["localmoe"], res["llama.cpp"]
        print(f"  round {r + 1}: decode {ours['decode']:6.1f} vs {theirs['decode']:6.1f} tok/s "
              f"({ours['decode'] / theirs['decode']:.2f}x), prefill {ours['prefill']:6.1f} vs "
              f"{theirs['prefill']:6.1f} tok/s ({ours['prefill'] / theirs['prefill']:.2f}x), read bandwidth "
              f"{bandwidth[-1] / 1e9:.1f} GB/s", flush=True)

    print(f"{family} {size} as {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB, quantised by llama.cpp), "
          f"{args.threads} threads, {args.prompt}-token prompt, {args.decode} greedy tokens, {args.pairs} alternating "
          f"rounds", flush=True)
    torch.set_num_threads(args.threads)
    bandwidth: list[float] = []
    clock = time.process_time if args.cpu_time else time.perf_counter  # the engines' own clock
    res = alternate(workers, args.pairs, between=lambda: bandwidth.append(memory_read_bandwidth(clock=clock)), show=show)
    ours, theirs = res["localmoe"], res["llama.cpp"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode", "prefill")} for k, v in res.items()}
    a, b = np.load(logits["localmoe"]).astype(np.float64), np.load(logits["llama.cpp"]).astype(np.float64)
    print(f"  medians: decode {med['localmoe']['decode']:.1f} vs {med['llama.cpp']['decode']:.1f} tok/s, "
          f"localmoe / llama.cpp {median_ratio([r['decode'] for r in ours], [r['decode'] for r in theirs]):.2f}x; "
          f"prefill {med['localmoe']['prefill']:.1f} vs {med['llama.cpp']['prefill']:.1f} tok/s, "
          f"{median_ratio([r['prefill'] for r in ours], [r['prefill'] for r in theirs]):.2f}x")
    print(f"  {roofline(ours[0]['bytes'], med['localmoe']['decode'], med['llama.cpp']['decode'], statistics.median(bandwidth))}")
    print(f"  logits at the prompt's last position: correlation {np.corrcoef(a, b)[0, 1]:.5f}, max |diff| "
          f"{np.abs(a - b).max() / (b.max() - b.min()):.2e} of the range, same argmax: {int(a.argmax()) == int(b.argmax())}",
          flush=True)
    like_for_like(gguf, args, work / f"{family}-{size}-{args.quant}", a, b)


def agree(a, b) -> str:
    """Two logit vectors' agreement: Pearson correlation, max |diff| over b's range, same argmax."""
    import numpy as np

    return (f"correlation {np.corrcoef(a, b)[0, 1]:.5f}, max |diff| {np.abs(a - b).max() / (b.max() - b.min()):.2e} of "
            f"the range, same argmax: {int(a.argmax()) == int(b.argmax())}")


def like_for_like(gguf: Path, args, stem: Path, ours, theirs) -> None:
    """The logits on the file's function without rounding (module doc): a twin of `gguf` whose quantised tensors are
    F32 values by gguf's numpy dequantiser, run by both engines on fp32 activations (localmoe `--expert-precision
    exact`; llama.cpp's F32 matrices take fp32 x, its KV cache is F32), every prompt position (k3_cpu.positions),
    judged before the first router near-tie; then each engine's logits on the quantised file (`ours`, `theirs`: int8
    activations, per 256 as llama.cpp's Q8_K) against llama.cpp's on the twin."""
    import gguf as gguf_py
    from k3_cpu import agreement, positions

    from localmoe.testing.gguf_split import rewrite_gguf

    twin = gguf.with_name(gguf.stem + "-dequantized.gguf")
    if not twin.exists():
        tensors = gguf_py.GGUFReader(gguf).tensors
        quantised_types = tuple(sorted({t.tensor_type.name for t in tensors if t.tensor_type.name not in ("F32", "F16")}))
        if sum(int(t.n_elements) * 4 for t in tensors) > args.twin_limit * 1e9:
            print(f"  logits without rounding: the F32 twin would exceed --twin-limit {args.twin_limit:g} GB: not run")
            return
        rewrite_gguf(gguf, twin.with_suffix(".tmp"), dequantize=quantised_types)
        twin.with_suffix(".tmp").rename(twin)
    common = ["--threads", str(args.threads), "--prompt", str(args.prompt)]
    a, b = (positions(name, twin, "exact", common, Path(f"{stem}-twin-{name}.npz")) for name in ("localmoe", "llama"))
    print(f"  logits on the F32 twin (the file's weights dequantised by gguf's numpy code), fp32 activations in both: "
          f"{agreement(a['logits'], b['logits'], a['margin'], args.tie_margin)}; last position {agree(a['logits'][-1], b['logits'][-1])}")
    reference = b["logits"][-1].astype("float64")
    print(f"  against llama.cpp on the twin, last position: localmoe on the file (int8 activations) {agree(ours, reference)}; "
          f"llama.cpp on the file {agree(theirs, reference)}; localmoe on the twin {agree(a['logits'][-1], reference)}",
          flush=True)


def quantised(family: str, size: str, args, work: Path, src: Path) -> Path:
    """The `args.quant` GGUF of the generated model: llama.cpp's converter + quantiser, localmoe's writer, or
    localmoe's writer then llama.cpp's quantiser (`requantised`)."""
    if args.writer == "llama.cpp":
        _, f32 = prepare(family, size, "f32", work, src)
        return requantised(f32, args.quant)
    from localmoe.testing import write_checkpoint
    from localmoe.testing.moe_gguf import write_moe_gguf
    from localmoe.testing.planned import PlannedCheckpoint

    out = work / f"{family}-{size}-localmoe.{args.quant.upper()}.gguf"
    if not out.exists():
        hf = work / f"{family}-{size}"
        planned = family != "kimi_k3"  # the tensors computed as the writer reads them, no shards on disk (K3's reads files)
        if not (hf / "config.json").exists():
            write_checkpoint(family, hf, size, seed=0, progress=False, weights=not planned)
        write_moe_gguf(hf, out, args.quant, ckpt=PlannedCheckpoint(family, size) if planned and not any(
            hf.glob("*.safetensors")) else None)
    if args.writer == "requantised":  # through Q8_0: llama.cpp copies a tensor already of the target type as it is
        final = work / f"{family}-{size}-requantised.{args.quant.upper()}.gguf"
        if not final.exists():
            q8 = requantised(out, "q8_0", work / f"{family}-{size}-requantised.Q8_0.gguf")
            requantised(q8, args.quant, final)
            q8.unlink()
        return final
    return out


def paged_compare(family: str, size: str, args, work: Path, src: Path) -> None:
    import json
    import os

    from offload import SLACK, _run_child

    from localmoe.convert import convert
    from localmoe.paging import expert_bytes
    from localmoe.paging.budget import MemoryCgroup, cgroup_writable
    from localmoe.store.packed import PackedStore

    if not cgroup_writable():
        raise SystemExit("--paged needs a writable cgroup v1 memory controller (root)")
    gguf = quantised(family, size, args, work, src)
    store = work / f"{gguf.stem}.lmoe"
    if not (store / "manifest.json").exists():
        convert(gguf, store)
    total = expert_bytes(PackedStore(store))
    budget = int(total * float(args.paged.rstrip("%")) / 100)
    child = argparse.Namespace(threads=args.threads, tokens=args.decode)
    common = ["--dtype", "auto", "--trace-out", str(work / "paged-trace.json")]
    group = f"localmoe-gguf-{os.getpid()}"

    def run(kind: str, limit: int) -> dict:
        name = f"{group}-{kind}"
        extra = ["--store", str(store), "--budget", str(budget), *common] if kind == "localmoe" else \
            ["--gguf", str(gguf)]
        try:
            out = _run_child(kind, child, [*extra, "--cgroup", name, "--limit", str(limit)], 3600)
        finally:
            MemoryCgroup(name).remove()
        if "error" in out:
            raise SystemExit(f"{kind} failed: {out['error']}")
        return out

    probe = run("localmoe", 0)
    limit = probe["footprint"] + SLACK
    print(f"{family} {size} as {gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB, experts {total / 1e9:.2f} GB), "
          f"localmoe paged at {args.paged} ({budget / 1e9:.2f} GB of slots), both engines under one cgroup limit of "
          f"{limit / 1e9:.2f} GB (localmoe's footprint {probe['footprint'] / 1e9:.2f} GB + {SLACK >> 20} MiB), "
          f"{args.threads} threads, {args.decode} greedy tokens after a 2-token prompt, {args.pairs} alternating "
          f"rounds", flush=True)
    ratios = []
    for r in range(args.pairs):
        res = {kind: run(kind, limit) for kind in (("localmoe", "llama") if r % 2 == 0 else ("llama", "localmoe"))}
        ours, theirs = res["localmoe"], res["llama"]
        ratios.append(ours["decode_tok_s"] / theirs["decode_tok_s"])
        same = sum(a == b for a, b in zip(ours["tokens"], theirs["tokens"]))
        print(f"  round {r + 1}: localmoe {ours['decode_tok_s']:.2f} tok/s (peak {ours['max_usage'] / 1e9:.2f} GB, "
              f"limit hit {ours['failcnt']}x; {ours['summary']}), llama.cpp mmap {theirs['decode_tok_s']:.2f} tok/s "
              f"(peak {theirs['max_usage'] / 1e9:.2f} GB, limit hit {theirs['failcnt']}x): {ratios[-1]:.2f}x; "
              f"greedy tokens equal {same}/{len(ours['tokens'])}", flush=True)
    print(f"  median localmoe / llama.cpp at {args.paged} RAM, same limit: {statistics.median(ratios):.2f}x")
    print("  " + json.dumps({"ratios": ratios, "limit": limit}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3_moe:small,glm4_moe:small", help="family:size, comma-separated")
    parser.add_argument("--quant", default="q4_k_m", choices=("q4_k_m", "q5_k_m", "q6_k", "q8_0"))
    parser.add_argument("--paged", help="the equal-memory comparison at this RAM share of the experts (e.g. 25%%)")
    parser.add_argument("--writer", choices=("llama.cpp", "localmoe", "requantised"), default="llama.cpp",
                        help="who writes the quantised GGUF (module doc)")
    parser.set_defaults(dtype="auto", expert_precision="q8")  # every block type as stored; int8 activations
    args_seen = parser.parse_known_args()[0]
    peer_benchmark(parser, paged_compare if args_seen.paged else compare, localmoe_worker)


if __name__ == "__main__":
    main()
