"""Resuming a preempted sequence: swap (its cache written to a file and read back, engine/swap.py) against
recompute (its prompt and every generated token run again), on the embedded model.

    python benchmarks/preemption.py                       # prompt 45 tokens, 16 / 64 / 256 generated
    python benchmarks/preemption.py --prompt 400 --generated 32,128

For each case a sequence is prefilled and decodes greedily (one row of the batched step per token, as the
worker runs it), then is preempted and resumed both ways, alternating, `--rounds` times; printed per case:
the cache's bytes, CPU time (this process, one thread) and wall time from the preemption until the
sequence has its next logits again (swap: write + read; recompute: prefill + one decode step per generated
token), medians, and recompute / swap. The resumed logits are checked equal to the unpaused ones.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=45, help="prompt tokens")
    parser.add_argument("--generated", default="16,64,256", help="comma-separated generated-token counts")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    from localmoe.config import EngineConfig
    from localmoe.engine.generate import Decoder, decode_together
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model

    torch.set_num_threads(1)
    model = load_model(None, EngineConfig(threads=1), progress=False).model
    prompt = [(37 * i + 11) % 40000 + 100 for i in range(args.prompt)]
    swap_dir = tempfile.mkdtemp(prefix="localmoe-swap-bench-")

    def step(dec: Decoder):
        """The next logits as the worker's batched step gives them for this model (a decode row, or a prompt
        chunk as rows: `rows_independent`); None while a prompt or a recompute's replay goes on."""
        if dec.decoding:
            return decode_together([dec])[0]
        return decode_together([], False, [(dec, dec.chunk)])[0] if dec.prefilling else dec.logits()

    def run_to(generated: int) -> Decoder:
        """A sequence that has drawn `generated` tokens (the last one pending: its next step is a decode)."""
        dec = Decoder(model, prompt, SamplingParams(temperature=0.0))
        for _ in range(generated):
            while (logits := step(dec)) is None:
                pass
            dec.feed([dec.sample(logits)])
        return dec

    print(f"prompt {args.prompt} tokens, {args.rounds} rounds, medians")
    for generated in (int(g) for g in args.generated.split(",")):
        reference = run_to(generated)
        nbytes = reference.cache.nbytes()
        want = step(reference)  # the logits the sequence gets unpaused
        times: dict[str, list[tuple[float, float]]] = {"swap": [], "recompute": []}
        for r in range(args.rounds):
            for kind in (("swap", "recompute") if r % 2 == 0 else ("recompute", "swap")):
                dec = run_to(generated)
                cpu, wall = time.process_time(), time.perf_counter()
                dec.preempt(swap_dir if kind == "swap" else None)
                dec.resume()
                while (got := step(dec)) is None:
                    pass
                times[kind].append((time.process_time() - cpu, time.perf_counter() - wall))
                if not torch.equal(got, want):
                    raise SystemExit(f"{kind}: the resumed logits differ from the unpaused ones")
        swap, recompute = ([statistics.median(t[i] for t in times[k]) for i in (0, 1)] for k in ("swap", "recompute"))
        print(f"  generated {generated:4d}: cache {nbytes / 2**20:6.1f} MiB  swap cpu {swap[0] * 1e3:7.1f} ms "
              f"wall {swap[1] * 1e3:7.1f} ms  recompute cpu {recompute[0] * 1e3:7.1f} ms wall "
              f"{recompute[1] * 1e3:7.1f} ms  recompute/swap: cpu {recompute[0] / swap[0]:.1f}x "
              f"wall {recompute[1] / swap[1]:.1f}x", flush=True)


if __name__ == "__main__":
    main()
