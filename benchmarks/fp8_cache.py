"""FP8 (e4m3 + fp32 scale per token and head) K/V and MLA latent cache against the fp32 cache.

bf16 and fp8 caches keep their newest 32 positions exact (engine/cache.EXACT_RECENT); use
--prompt well above that (the default 160) so most of what attention reads is rounded.

For each family's generated checkpoint: greedy decode with the fp32 cache, then the same tokens
fed through an fp8 (and bf16) cache (teacher forced, so every step compares like with like).
Prints the max and mean |logit diff| relative to each step's logit range, how many greedy
tokens change (and the fp32 top-2 margin where they do), how long a free-running fp8 decode
keeps the fp32 tokens, and the cache bytes ratio (per token, and allocated by the run).

    .venv/bin/python benchmarks/fp8_cache.py [--size tiny|small] [--tokens 64] [--families gpt_oss,kimi_k3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch
from common import report

FAMILIES = ("default", "gpt_oss", "kimi_linear", "kimi_k3")  # default: the embedded model
REAL_TEXT = ("The mixture-of-experts layer routes every token to a few experts chosen by a learned "
             "router, so a model with hundreds of billions of parameters reads only a small part of "
             "them per token. Paging those experts between disk, host memory and the GPU is what lets "
             "one workstation run it. ")


def new_cache(model, batch: int, max_len: int, dtype: str):
    """The model's cache with every layer in `dtype`: one loaded model compared across cache dtypes
    (Transformer.new_cache takes the one EngineConfig.kv_cache_dtype)."""
    from localmoe.engine.cache import ModelCache

    return ModelCache([mixer.new_cache(batch, max_len, dtype) for _, mixer, _, _ in model.layers], batch, max_len)


def run(model, prompt: torch.Tensor, tokens: list[int] | None, steps: int, dtype: str):
    """Logits before each step [steps, V], the tokens fed/chosen, and the cache."""
    cache = new_cache(model, 1, prompt.shape[1] + steps, dtype)
    logits = model.forward(prompt, cache)[:, -1]
    out, chosen = [], []
    for t in range(steps):
        out.append(logits[0])
        chosen.append(int(logits.argmax()) if tokens is None else tokens[t])
        logits = model.forward(torch.tensor([[chosen[-1]]]), cache)[:, -1]
    return torch.stack(out), chosen, cache


def paged_bytes(cache) -> int:
    return sum(layer.nbytes() for layer in cache.layers if getattr(layer, "paged", False))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="tiny", choices=("tiny", "small"))
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=160)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint
    from localmoe.testing.parity import random_tokens

    torch.set_num_threads(args.threads)
    for family in args.families.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            config = EngineConfig(dtype="float32", threads=args.threads)
            if family == "default":  # the embedded SmolLM2: trained weights, a prompt of real text
                loaded = load_model(None, config, progress=False)
                words = (REAL_TEXT * 20).split()
                prompt = torch.tensor([loaded.tokenizer.encode(" ".join(words))[:args.prompt]])
                label = "default (SmolLM2-135M-Instruct, trained weights, real text)"
            else:
                path = write_checkpoint(family, Path(tmp), args.size, seed=0)
                loaded = load_model(path, config, progress=False)
                prompt = random_tokens(args.prompt, 1, loaded.spec.vocab_size)
                label = f"{family} {args.size} (random weights)"
            model, spec = loaded.model, loaded.spec
            print(f"fp8_cache: {label} ({time.perf_counter() - start:.1f} s to load), "
                  f"{prompt.shape[1]}-token prompt + {args.tokens} greedy tokens", flush=True)
            ref, tokens, ref_cache = run(model, prompt, None, args.tokens, "float32")
            span = ref.amax(-1) - ref.amin(-1)
            top2 = ref.topk(2, dim=-1).values
            margin = (top2[:, 0] - top2[:, 1]) / span
            rows = []
            for dtype in ("bfloat16", "fp8"):
                logits, _, cache = run(model, prompt, tokens, args.tokens, dtype)
                rel = (logits - ref).abs().amax(-1) / span
                flips = logits.argmax(-1) != ref.argmax(-1)
                _, free, _ = run(model, prompt, None, args.tokens, dtype)
                agree = next((i for i, (a, b) in enumerate(zip(free, tokens)) if a != b), len(tokens))
                bytes_ratio = spec.kv_bytes_per_token(dtype) / spec.kv_bytes_per_token()
                state = cache.nbytes() - paged_bytes(cache)
                rows += [
                    (f"{dtype} logit error", (f"max {rel.max():.2%}, mean {rel.mean():.3%} of the logit range "
                                              f"(steps over 5%: {int((rel > 0.05).sum())}/{args.tokens})")),
                    (f"{dtype} greedy", (f"{int(flips.sum())} of {args.tokens} teacher-forced tokens change (fp32 "
                                         f"top-2 margins {[round(m, 4) for m in margin[flips].tolist()]} of the "
                                         f"range); free-running equal for {agree}/{args.tokens}")),
                    (f"{dtype} cache bytes", (f"{bytes_ratio:.3f} of fp32 per token; allocated "
                                              f"{paged_bytes(cache) / 2**10:.0f} KiB vs "
                                              f"{paged_bytes(ref_cache) / 2**10:.0f} KiB (+ {state / 2**10:.0f} KiB "
                                              "fp32 delta state)")),
                ]
            report(rows)


if __name__ == "__main__":
    main()
