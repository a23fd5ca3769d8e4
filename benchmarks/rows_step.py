"""The batched decode step on the embedded model in CPU time: one row against N rows (engine/batch.py
`forward_rows`, the dense plan over N rows), and the lm_head's share, what bounds `benchmarks/serving.py`'s
N-clients-vs-one ratio from above (issue 23: a 16-row step must cost <= ~2.7 one-row steps for 6x).

    python benchmarks/rows_step.py [--rows 16] [--context 40] [--rounds 4] [--steps 3] [--max-len 8192] [-- --expert-precision q8-all]

N sequences are prefilled with prompts of `--context` tokens (different tokens, the same length), then each
round times `--steps` steps of one sequence alone and `--steps` steps of all N (the two alternated, the
caches trimmed back after each step, untimed, so the context stays put), the lm_head alone on 1 and N rows, and
`--steps` of one sequence's own fused decode step (the model's forward: what `localmoe run` and one client take).
`--kv-cache-dtype bfloat16 / fp8`: the caches in that dtype (read and written in it by the plans).
Printed: the medians over rounds of CPU ms per step (one thread: `time.process_time`, so the figures hold on
a loaded machine) and the ceiling N x t(1) / t(N) on the aggregate tokens/s of N clients against one.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--expert-precision", default="q8")
    parser.add_argument("--kv-cache-dtype", default="float32")
    parser.add_argument("--max-len", type=int, default=0,
                        help="each cache's max_len (0: context + 8; the server's caches: the model's context, 8192, "
                             "so 256-token blocks)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    from localmoe.config import EngineConfig
    from localmoe.engine import batch
    from localmoe.engine.generate import prefill
    from localmoe.engine.quantized import decode_rows
    from localmoe.load import load_model

    model = load_model(None, EngineConfig(threads=1, expert_precision=args.expert_precision,
                                          kv_cache_dtype=args.kv_cache_dtype), progress=False).model
    vocab = model.spec.vocab_size
    caches = []
    for i in range(args.rows):
        cache = model.new_cache(1, args.max_len or args.context + 8)
        prefill(model, torch.randint(0, vocab, (args.context,), generator=torch.Generator().manual_seed(i)).tolist(),
                cache)
        caches.append(cache)
    tokens = [(17 + 31 * i) % vocab for i in range(args.rows)]
    h = torch.randn(args.rows, model.spec.hidden_size, generator=torch.Generator().manual_seed(0))

    def steps(n: int) -> float:
        spent = 0.0
        for _ in range(args.steps):
            start = time.process_time()
            batch.forward_rows(model, tokens[:n], caches[:n])
            spent += time.process_time() - start
            for cache in caches[:n]:  # not timed: 30 layers' trims cost ~0.25 ms a cache
                cache.trim(args.context)
        return spent / args.steps * 1e3

    def fused() -> float:  # one sequence's own decode step (the fused plan: `localmoe run`, a one-client server)
        spent = 0.0
        with torch.inference_mode():
            for _ in range(args.steps):
                start = time.process_time()
                model.forward(torch.tensor([[tokens[0]]]), caches[0])
                spent += time.process_time() - start
                caches[0].trim(args.context)
        return spent / args.steps * 1e3

    def head(n: int) -> float:
        start = time.process_time()
        with decode_rows():  # as the step calls it: rows through the block kernel
            for _ in range(args.steps):
                model.lm_head(h[:n])
        return (time.process_time() - start) / args.steps * 1e3

    steps(1), steps(args.rows), fused()  # warm-up: plans built, pages touched
    one, many, head1, head_n, alone = [], [], [], [], []
    for _ in range(args.rounds):
        alone.append(fused())
        one.append(steps(1))
        many.append(steps(args.rows))
        head1.append(head(1))
        head_n.append(head(args.rows))
    t1, tn = statistics.median(one), statistics.median(many)
    print(f"expert precision {args.expert_precision}, K/V {args.kv_cache_dtype}, context {args.context}: "
          f"1 row {t1:.2f} ms (head {statistics.median(head1):.2f}), {args.rows} rows {tn:.2f} ms "
          f"(head {statistics.median(head_n):.2f}); {args.rows} rows = {tn / t1:.2f} one-row steps, "
          f"ceiling {args.rows} x t(1) / t({args.rows}) = {args.rows * t1 / tn:.2f}x; fused one-token step "
          f"{statistics.median(alone):.2f} ms")


if __name__ == "__main__":
    main()
