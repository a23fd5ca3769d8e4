"""Decode through the fused hybrid step (engine/decode_plan.py) against the op-by-op engine, one model, one
process: the two paths alternate round by round (the same weights and prompt; each round prefills a fresh
cache untimed, then times `--tokens` greedy decode steps by the process's CPU time, 1 thread by default).
Prints each round's tokens/s and the per-round ratio, then the median ratio, and checks that both paths
chose the same tokens and that every fused step ran fused. `--cache` sets the K/V / latent / index cache dtype
(both paths the same).

    python benchmarks/fused_decode.py --model deepseek_v32:small --prompt 256 --tokens 32 --rounds 4 --cache fp8
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from localmoe.kernels.decode_layers.hybrid import HybridDecoder

from localmoe.config import KV_CACHE_DTYPES, EngineConfig
from localmoe.load import load_model
from localmoe.testing import write_checkpoint


def decode(model, prompt: list[int], tokens: int, fused: bool) -> tuple[float, list[int]]:
    """(CPU seconds of `tokens` greedy decode steps after `prompt`, the tokens chosen)."""
    model._plan = None
    if not fused:
        model._planned_step = lambda tokens, cache: None
    calls, call = [], HybridDecoder.__call__
    HybridDecoder.__call__ = lambda self, *args: calls.append(1) or call(self, *args)
    try:
        cache = model.new_cache(1, len(prompt) + tokens + 1)
        logits = model.forward(torch.tensor([prompt]), cache)
        chosen = []
        start = time.process_time()
        for _ in range(tokens):
            token = logits[:, -1].argmax(-1, keepdim=True)
            chosen.append(int(token))
            logits = model.forward(token, cache)
        seconds = time.process_time() - start
    finally:
        model.__dict__.pop("_planned_step", None)
        HybridDecoder.__call__ = call
    if fused and (type(model._plan.decoder).__name__ != "HybridDecoder" or len(calls) != tokens):
        raise SystemExit(f"the fused hybrid step ran {len(calls)} of {tokens} steps")
    return seconds, chosen


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="deepseek_v32:small", help="FAMILY:SIZE of a generated checkpoint")
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens (the context decode starts from)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache", default="float32", choices=KV_CACHE_DTYPES, help="the cache dtype (both paths)")
    ap.add_argument("--work", default=None, help="where the checkpoint is written (default: a temporary folder)")
    args = ap.parse_args()
    family, size = args.model.split(":")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.work or tmp) / f"{family}-{size}"
        if not (path / "config.json").exists():
            write_checkpoint(family, path, size=size, seed=0)
        model = load_model(path, EngineConfig(dtype=args.dtype, threads=args.threads, expert_precision="q8",
                                              max_context=args.prompt + args.tokens + 8, kv_cache_dtype=args.cache), progress=False).model
        vocab = model.spec.vocab_size
        prompt = [int(t) for t in torch.randint(3, vocab, (args.prompt,), generator=torch.Generator().manual_seed(0))]
        decode(model, prompt, 2, True)  # warm-up: builds the kernels and the plan
        ratios = []
        for r in range(args.rounds):
            runs = {}
            for fused in ((True, False) if r % 2 == 0 else (False, True)):
                runs[fused] = decode(model, prompt, args.tokens, fused)
            if runs[True][1] != runs[False][1]:
                print(f"round {r}: the paths chose different tokens")
            rate = {k: args.tokens / s for k, (s, _) in runs.items()}
            ratios.append(rate[True] / rate[False])
            print(f"round {r}: fused {rate[True]:.1f} tok/s, op by op {rate[False]:.1f} tok/s, {ratios[-1]:.2f}x",
                  flush=True)
        print(f"{args.model} prompt {args.prompt}, {args.tokens} tokens, {args.threads} thread(s), {args.cache} cache: "
              f"fused / op by op "
              f"median {statistics.median(ratios):.2f}x ({', '.join(f'{x:.2f}' for x in ratios)})")


if __name__ == "__main__":
    main()
