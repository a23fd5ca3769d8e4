"""Time to first token of a chat's next turn with and without the prefix cache (engine/prefix_cache.py).

A conversation of about --tokens prompt tokens is answered once (its cache goes to the prefix
cache); then the next turn (that conversation, the reply and a new question) is timed fresh and
with the cache. Prints both times to first token, the reused tokens and the ratio, and checks
the two runs' first logits are identical (reuse is exact by construction).

    .venv/bin/python benchmarks/prefix_cache.py [--tokens 1500] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch
from common import report


def first_logits(model, prompt: list[int], params, prefix_cache=None):
    from localmoe.engine.generate import Decoder

    start = time.perf_counter()
    dec = Decoder(model, prompt, params, prefix_cache=prefix_cache)
    logits = None
    while logits is None:
        logits = dec.logits()
    return time.perf_counter() - start, logits, dec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from localmoe.chat import ChatMessage
    from localmoe.config import EngineConfig
    from localmoe.engine.prefix_cache import PrefixCache
    from localmoe.engine.sampler import SamplingParams
    from localmoe.load import load_model

    loaded = load_model(None, EngineConfig(threads=args.threads), progress=False)
    model, fmt = loaded.model, loaded.chat_format
    facts, history = [], []
    while True:
        facts.append(f"Note {len(facts)}: shipment {len(facts) * 7 % 101} left dock {len(facts) % 9} on time.")
        history = [ChatMessage("user", " ".join(facts) + "\nSummarise the notes.")]
        if len(fmt.render(history)) >= args.tokens:
            break
    greedy = SamplingParams(temperature=0.0)
    cache = PrefixCache()
    first = fmt.render(history)
    _, logits, dec = first_logits(model, first, greedy, cache)
    reply = []
    for _ in range(16):
        token = dec.sample(logits)
        if token in fmt.stop_token_ids():
            break
        reply.append(token)
        dec.feed([token])
        logits = dec.logits()
    dec.release()
    history += [ChatMessage("assistant", loaded.tokenizer.decode(reply)), ChatMessage("user", "Which dock is busiest?")]
    second = fmt.render(history)
    fresh_s, fresh_logits, _ = first_logits(model, second, greedy)
    cached_s, cached_logits, cached = first_logits(model, second, greedy, cache)
    print(f"prefix_cache: embedded model, next turn of {len(second)} prompt tokens ({args.threads} threads)")
    report([
        ("fresh prefill", f"{fresh_s:.2f} s to first token"),
        ("with the prefix cache", f"{cached_s:.2f} s to first token, {cached.reused} of {len(second)} tokens reused"),
        ("speed-up", f"{fresh_s / cached_s:.1f}x"),
        ("first logits identical", str(torch.equal(fresh_logits, cached_logits))),
    ])


if __name__ == "__main__":
    main()
