"""MoE GGUFs quantised by llama.cpp itself: localmoe against llama.cpp on the SAME file.

Each model is a generated random checkpoint (`localmoe.testing`, real layout) converted to an F32 GGUF by
llama.cpp's own `convert_hf_to_gguf.py` (benchmarks/k3_cpu.py fetches it), then quantised by llama.cpp's own
quantiser (llama-cpp-python's `llama_model_quantize`, as decode_dense.py --quant does) to Q4_K_M: Q4_K with
Q6_K where llama-quantize gives more bits, routed experts included. Both engines run that one file, same
threads, greedy; localmoe keeps every block type as stored (`--dtype auto`) and computes the experts from
their blocks (expert precision q8: activations rounded to int8 per 32 values, per 256 for K-quant rows and the
Q6_K lm_head, as llama.cpp does). The engines
alternate in separate processes (benchmarks/alternate.py); printed per round and as medians: prefill and
decode tokens/s and localmoe / llama.cpp, and the agreement of the logits at the prompt's last position
(Pearson correlation, max |diff| over the range, same argmax).

    python benchmarks/gguf_moe.py [--models qwen3_moe:small,glm4_moe:small] [--quant q4_k_m] [--threads 2]
                                  [--pairs 4] [--prompt 72] [--decode 64] [--work DIR]

Not measured here: paging at 25% RAM under a cgroup limit against llama.cpp's mmap (benchmarks/offload.py
has the cgroup harness), and K3 (llama-quantize requantises its MXFP4 experts to Q5_0 / Q4_K, which
localmoe's kimi_k3 GGUF reader refuses: its expected tensors are the MXFP4 parts).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from alternate import alternate, median_ratio
from decode_dense import requantised
from k3_cpu import localmoe_worker, peer_benchmark, prepare


def compare(family: str, size: str, args, work: Path, src: Path) -> None:
    import numpy as np

    _, f32 = prepare(family, size, "f32", work, src)
    gguf = requantised(f32, args.quant)
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
              f"{theirs['prefill']:6.1f} tok/s ({ours['prefill'] / theirs['prefill']:.2f}x)", flush=True)

    print(f"{family} {size} as {gguf.name} ({gguf.stat().st_size / 1e6:.0f} MB, quantised by llama.cpp), "
          f"{args.threads} threads, {args.prompt}-token prompt, {args.decode} greedy tokens, {args.pairs} alternating "
          f"rounds", flush=True)
    res = alternate(workers, args.pairs, show=show)
    ours, theirs = res["localmoe"], res["llama.cpp"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode", "prefill")} for k, v in res.items()}
    a, b = np.load(logits["localmoe"]).astype(np.float64), np.load(logits["llama.cpp"]).astype(np.float64)
    print(f"  medians: decode {med['localmoe']['decode']:.1f} vs {med['llama.cpp']['decode']:.1f} tok/s, "
          f"localmoe / llama.cpp {median_ratio([r['decode'] for r in ours], [r['decode'] for r in theirs]):.2f}x; "
          f"prefill {med['localmoe']['prefill']:.1f} vs {med['llama.cpp']['prefill']:.1f} tok/s, "
          f"{median_ratio([r['prefill'] for r in ours], [r['prefill'] for r in theirs]):.2f}x")
    print(f"  logits at the prompt's last position: correlation {np.corrcoef(a, b)[0, 1]:.5f}, max |diff| "
          f"{np.abs(a - b).max() / (b.max() - b.min()):.2e} of the range, same argmax: {int(a.argmax()) == int(b.argmax())}",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="qwen3_moe:small,glm4_moe:small", help="family:size, comma-separated")
    parser.add_argument("--quant", default="q4_k_m", choices=("q4_k_m", "q5_k_m", "q6_k", "q8_0"))
    parser.set_defaults(dtype="auto", expert_precision="q8")  # every block type as stored; int8 activations
    peer_benchmark(parser, compare, localmoe_worker)


if __name__ == "__main__":
    main()
