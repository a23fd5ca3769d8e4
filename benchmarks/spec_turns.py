"""Speculation through the service, in one process: the same chat turn with `--spec off` and `--spec prompt`
(and other most drafts per step), turn by turn.

    python benchmarks/spec_turns.py --task code --rounds 6
    python benchmarks/spec_turns.py --task document --rounds 4 --also-k 4

The embedded SmolLM2 answers a task of spec.py through `LocalModel.events` (the service's chat turn: its prompt
rendering, prompt chunks, streaming and stop handling; `--batching off`, the model's fused step, as `run` takes),
greedy, at most 128 tokens. Each round runs every configuration's turn once, the order rotated every round; the
ratio per round is off's process CPU time per token (from the first token) over each one's, then the median.
Running them in one process puts them under the same load, caches and frequency (spec.py's process pairs scatter
by 5-10% on a loaded host); texts are compared with off's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from spec import TASKS

from localmoe.config import SPEC_K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--task", default="code", choices=list(TASKS))
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=SPEC_K)
    ap.add_argument("--also-k", type=int, nargs="*", default=[])
    ap.add_argument("--max-tokens", type=int, default=128)
    args = ap.parse_args()

    from localmoe.config import EngineConfig
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model
    from localmoe.runtime.local import LocalModel
    from localmoe.runtime.service import ServerConfig

    loaded = load_model(None, EngineConfig(threads=args.threads), progress=False)
    configs = {"off": ("off", args.k), f"prompt@{args.k}": ("prompt", args.k),
               **{f"prompt@{k}": ("prompt", k) for k in args.also_k}}
    models = {name: LocalModel(loaded, ServerConfig(prefix_cache_entries=0, spec=spec, spec_k=k, batching="off"))
              for name, (spec, k) in configs.items()}

    def turn(local):
        first, text, result = None, [], None
        for kind, payload in local.events(TASKS[args.task], SamplingParams(temperature=0.0), args.max_tokens):
            if kind == "done":
                result = payload
            else:
                text.append(payload.text)
                first = time.process_time() if first is None else first
        return (time.process_time() - first) / max(1, result.completion_tokens - 1), "".join(text), result

    names = list(configs)
    for name in names:  # warm-up: every kernel's first use
        turn(models[name])
    ratios = {name: [] for name in names[1:]}
    for r in range(args.rounds):
        got = {name: turn(models[name]) for name in names[r % len(names):] + names[:r % len(names)]}
        line = f"round {r + 1}: off {1e3 * got['off'][0]:.2f} ms/token CPU"
        for name in names[1:]:
            ratios[name].append(got["off"][0] / got[name][0])
            s = got[name][2].spec
            line += (f"; {name} {ratios[name][-1]:.3f}x ({s.acceptance:.0%} kept, {s.tokens_per_step:.2f} tokens/step)"
                     + ("" if got[name][1] == got["off"][1] else " (TEXT DIFFERS)"))
        print(line, flush=True)
    print("median over rounds: " + ", ".join(f"{name} {statistics.median(v):.3f}x" for name, v in ratios.items()))


if __name__ == "__main__":
    main()
