"""LFRU's victim choice: vectorised (`victim`) against the per-candidate Python scan (`naive_victim`).

A synthetic routing trace of realistic size (--layers x --experts, top --top-k, Zipf-skewed
popularity) is replayed with slots for --fraction of the experts. Once the slots are full, each
eviction asks both choices on the same policy state (they must agree), timing each and counting
Python function calls (a profiler hook) for the first --count evictions. Prints both and the ratios.

    .venv/bin/python benchmarks/lfru_victim.py [--layers 60] [--experts 896] [--fraction 0.25]
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from common import report


def calls(fn, *args) -> tuple[object, int]:
    """`fn(*args)` and the Python and C function calls it made."""
    n = 0

    def hook(frame, event, arg):
        nonlocal n
        n += event in ("call", "c_call")

    sys.setprofile(hook)
    try:
        out = fn(*args)
    finally:
        sys.setprofile(None)
    return out, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=60)
    parser.add_argument("--experts", type=int, default=896)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--zipf", type=float, default=0.6)
    parser.add_argument("--evictions", type=int, default=40)
    parser.add_argument("--count", type=int, default=5)
    args = parser.parse_args()

    from localmoe.paging.policy import LFRU

    rng = np.random.default_rng(0)
    p = 1.0 / np.arange(1, args.experts + 1) ** args.zipf
    p /= p.sum()
    slots = int(args.fraction * args.layers * args.experts)
    policy, resident = LFRU(), set()
    fast_t = slow_t = 0.0
    fast_n = slow_n = timed = counted = 0
    step = 0
    while timed < args.evictions:
        for layer in range(args.layers):
            for e in rng.choice(args.experts, args.top_k, replace=False, p=p).tolist():
                key = (layer, e)
                if key not in resident:
                    if len(resident) >= slots:
                        cands = list(resident)
                        if counted < args.count:
                            v, n1 = calls(policy.victim, cands, step)
                            _, n2 = calls(policy.naive_victim, cands, step)
                            fast_n, slow_n, counted = fast_n + n1, slow_n + n2, counted + 1
                        t0 = time.perf_counter()
                        v = policy.victim(cands, step)
                        t1 = time.perf_counter()
                        w = policy.naive_victim(cands, step)
                        t2 = time.perf_counter()
                        assert v == w, f"victims differ at step {step}: {v} != {w}"
                        fast_t, slow_t, timed = fast_t + t1 - t0, slow_t + t2 - t1, timed + 1
                        resident.discard(v)
                        policy.evict(v)
                    resident.add(key)
                    policy.insert(key, step)
                policy.access(key, step)
        step += 1
    report([
        ("trace", (f"{args.layers} layers x {args.experts} experts, top-{args.top_k}, {slots} slots, "
                  f"{step} tokens, {timed} evictions timed")),
        ("naive_victim", f"{slow_t / timed * 1e3:.2f} ms and {slow_n // counted} calls per eviction"),
        ("victim", f"{fast_t / timed * 1e3:.2f} ms and {fast_n // counted} calls per eviction"),
        ("ratio naive/vectorised", (f"time {slow_t / fast_t:.1f}x, calls {slow_n / fast_n:.1f}x "
                                   f"(same evictions, same victims)")),
    ])


if __name__ == "__main__":
    main()
