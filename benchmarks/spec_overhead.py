"""What speculation costs where it never pays: one process, step-interleaved.

    python benchmarks/spec_overhead.py --rounds 4 --threads 1

The embedded SmolLM2 on a prompt with nothing to quote (the `chat` task of spec.py); each round starts three
sequences of it: `off` (no speculator), `never` (a speculator whose drafter never drafts: the speculative
step's own bookkeeping) and `prompt` (prompt lookup, the default speculator's drafter). One decode step of each
in turn, the order rotated every step, each through the worker's step (`decode_together`, fused where the
model has a fused single-token step: `--batching off`, as `run`, `chat` and the Python API take; `--rows`: the
batched row step). Process CPU time per generated token, off over each (>= 1.00x: as fast as off), per round
and the median over rounds; and the CPU time per step outside the model's forward (engine/batch.py
`decode_batch` and a verify's `forward_rows` timed apart: sampling, the speculator, the Decoder's bookkeeping) and in
it (the same code in the three: what differs there is the load's). Interleaving steps in one process
puts the three under the same load, caches and frequency: process pairs scatter by 5% on a loaded host.
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


class Never:
    """A drafter with prompt lookup's traits that never finds a draft (what it costs is the speculative step's own
    bookkeeping: its call returns a draft made once)."""

    name, free, matches = "never", True, True

    def __init__(self):
        from localmoe.engine.spec.drafters import Draft

        self.none = Draft([])

    def propose(self, history, k, params, generator, least: int = 1):
        return self.none


FORWARD = [0.0]  # CPU seconds in the model's forward during the current step


def _timed(fn):
    def wrapper(*a, **kw):
        began = time.process_time()
        try:
            return fn(*a, **kw)
        finally:
            FORWARD[0] += time.process_time() - began

    return wrapper


def time_forwards() -> None:
    """Time the forwards a step runs (the fused / batched step, a verify's rows) apart from the rest."""
    from localmoe.engine import batch
    from localmoe.engine.spec import verify

    batch.decode_batch = verify.decode_batch = _timed(batch.decode_batch)
    verify.forward_rows = _timed(verify.forward_rows)


def run_round(loaded, prompt, args, order_seed: int) -> dict[str, dict]:
    import torch

    from localmoe.engine.generate import Decoder, decode_together
    from localmoe.engine.sampler import SamplingParams
    from localmoe.engine.spec.drafters import PromptLookup
    from localmoe.engine.spec.speculator import Speculator

    greedy = SamplingParams(temperature=0.0)
    model = loaded.model
    made = {"off": None, "never": Speculator(Never(), args.k),
            "prompt": Speculator(PromptLookup(tokenizer=loaded.tokenizer), args.k)}
    decs = {name: Decoder(model, prompt, greedy, speculator=s) for name, s in made.items()}
    for dec in decs.values():  # prefill, untimed
        logits = None
        while logits is None:
            logits = dec.logits()
        dec.feed([dec.sample(logits)])
    stats = {name: {"cpu": 0.0, "forward": 0.0, "tokens": 1, "steps": 0, "done": False, "text": []} for name in decs}
    stops = set(loaded.tokenizer.stop_token_ids)
    names = list(decs)
    step = order_seed
    fused = not args.rows
    with torch.inference_mode():
        while not all(s["done"] for s in stats.values()):
            step += 1
            for name in names[step % 3:] + names[:step % 3]:
                s, dec = stats[name], decs[name]
                if s["done"]:
                    continue
                FORWARD[0] = 0.0
                ran = not dec.ready
                began = time.process_time()
                logits = decode_together([dec], fused)[0] if dec.decoding and not dec.ready else dec.logits()
                token = dec.sample(logits)
                s["cpu"] += time.process_time() - began
                s["forward"] += FORWARD[0]
                s["steps"] += ran
                s["tokens"] += 1
                s["text"].append(token)
                if token in stops or s["tokens"] >= args.max_tokens:
                    s["done"] = True
                    dec.release()
                else:
                    dec.feed([token])
    for name, sp in made.items():
        stats[name]["spec"] = sp.stats if sp is not None else None
        stats[name]["shadows"] = sp.shadow_tries if sp is not None else 0
    return stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=SPEC_K)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--task", default="chat", choices=list(TASKS))
    ap.add_argument("--rows", action="store_true", help="the batched row step (serve's for this model), not the fused one")
    args = ap.parse_args()

    from localmoe.chat import ChatMessage, chat_format_for
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    loaded = load_model(None, EngineConfig(threads=args.threads), progress=False)
    prompt = chat_format_for(loaded.spec, loaded.tokenizer).render([ChatMessage("user", TASKS[args.task])])
    time_forwards()
    run_round(loaded, prompt, args, 0)  # warm-up: every kernel's first use
    ratios = {"never": [], "prompt": []}
    outside = {"off": [], "never": [], "prompt": []}
    forward = {"off": [], "never": [], "prompt": []}
    for r in range(args.rounds):
        stats = run_round(loaded, prompt, args, r)
        per = {name: s["cpu"] / s["tokens"] for name, s in stats.items()}
        for name, s in stats.items():
            outside[name].append((s["cpu"] - s["forward"]) / s["steps"])
            forward[name].append(s["forward"] / s["steps"])
        same = all(s["text"] == stats["off"]["text"] for s in stats.values())
        line = f"round {r + 1}: off {1e3 * per['off']:.2f} ms/token CPU over {stats['off']['tokens']} tokens"
        for name in ratios:
            ratios[name].append(per["off"] / per[name])
            sp = stats[name]["spec"]
            line += (f"; {name} {ratios[name][-1]:.3f}x ({sp.drafted} drafted, {sp.accepted} kept, "
                     f"{stats[name]['shadows']} shadow tries)")
        print(line + ("" if same else "  (TEXT DIFFERS)"), flush=True)
    print("median over rounds: " + ", ".join(f"{name} {statistics.median(v):.3f}x" for name, v in ratios.items()))
    if args.rounds > 2:  # the mean's 95% interval (rounds as independent samples): beyond noise where it excludes a cost
        print("mean over rounds, 95% interval: " + ", ".join(
            f"{name} {statistics.mean(v):.4f}x +- {2 * statistics.stdev(v) / len(v) ** 0.5:.4f}"
            for name, v in ratios.items()))
    print("CPU time per step outside the forward, median over rounds: " +
          ", ".join(f"{name} {1e6 * statistics.median(v):.0f} us" for name, v in outside.items()))
    # the forward is the same code in the three: a difference here is the load's (or the caches'), not the speculator's
    # Python (session 17: 0-0.75% between them by run at load 4-5, as large as the cost outside the forward)
    print("CPU time of the forward per step, median over rounds: " +
          ", ".join(f"{name} {1e3 * statistics.median(v):.3f} ms" for name, v in forward.items()))


if __name__ == "__main__":
    main()
