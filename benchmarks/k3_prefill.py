"""Prefill against decode on the "small" generated Kimi K3 (random weights): tokens/s of each, alternated.

Each round prefills a PROMPT-token prompt (chunks of 512, the engine's PREFILL_CHUNK) into a fresh
cache, then decodes DECODE tokens greedily; the rounds alternate the two phases in one process,
so load from other processes falls on both. Printed: per round prefill and decode tokens/s and
prefill/decode (the target: >= 1, prefill never slower than decode), and the median ratio.
Run: .venv/bin/python benchmarks/k3_prefill.py [--prompt 1024] [--decode 32] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from localmoe.config import EngineConfig
from localmoe.engine.generate import prefill
from localmoe.load import load_model
from localmoe.testing import write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt", type=int, default=1024)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint("kimi_k3", Path(tmp) / "small", "small", seed=0)
        model = load_model(path, EngineConfig(dtype=args.dtype, max_context=args.prompt + args.decode + 8),
                           progress=False).model
        prompt = torch.randint(0, model.spec.vocab_size, (args.prompt,), generator=torch.Generator().manual_seed(0))
        print(f"small kimi_k3, {args.dtype} weights, {torch.get_num_threads()} threads: {args.prompt}-token prompt, "
              f"{args.decode} decoded tokens")
        ratios = []
        for round_ in range(args.rounds + 1):  # round 0 warms up (kernel builds, decode plans)
            cache = model.new_cache(1, args.prompt + args.decode + 8)
            start = time.perf_counter()
            logits = prefill(model, prompt.tolist(), cache)
            prefill_s = time.perf_counter() - start
            token = logits.argmax(-1).view(1, 1)
            start = time.perf_counter()
            for _ in range(args.decode):
                token = model.forward(token, cache)[:, -1].argmax(-1).view(1, 1)
            decode_s = time.perf_counter() - start
            if round_:
                pre, dec = args.prompt / prefill_s, args.decode / decode_s
                ratios.append(pre / dec)
                print(f"round {round_}: prefill {pre:7.1f} tok/s, decode {dec:6.1f} tok/s, prefill/decode {pre / dec:.2f}",
                      flush=True)
        print(f"median prefill/decode {statistics.median(ratios):.2f} (>= 1: prefill not slower than decode)")


if __name__ == "__main__":
    main()
