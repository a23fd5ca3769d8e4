"""What a bf16 / fp8 K/V cache (`--kv-cache-dtype`) costs in accuracy on the embedded model, against localmoe's fp32
cache and against llama.cpp on the same GGUF (llama-cpp-python, if installed: its default K/V cache is f16).

    python benchmarks/kv_cache_accuracy.py [--tokens 300] [--expert-precision q8] [--threads 1] [--no-llama]

One token sequence for every engine: a chat prompt and localmoe's greedy continuation over an fp32 cache, then
each engine decodes that sequence one token at a time (teacher-forced: the same inputs everywhere) and keeps the
logits of every decode position. Printed per engine against localmoe fp32 (and, with llama.cpp, against llama.cpp
at f16, its default, and f32): the largest |diff| over the logit range, the mean KL divergence of the next-token
distributions, and how often the top token agrees; then each engine's own greedy run from the prompt (the first
position where it leaves localmoe fp32's tokens). localmoe's steps run its fused decode plan, which reads the cache
in its own dtype; positions past the newest 32 are read rounded (engine/cache.py EXACT_RECENT)."""

from __future__ import annotations

import argparse

import torch

PROMPT = ("Write a detailed explanation of how a lighthouse works, covering the light source, the lens, the "
          "rotation mechanism and how ships use the signals to navigate at night.")


def _localmoe(args, dtype: str):
    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    return load_model(None, EngineConfig(threads=args.threads, expert_precision=args.expert_precision,
                                         kv_cache_dtype=dtype), progress=False)


def _teacher_forced(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """Logits [len(tokens), V] of decoding `tokens` one at a time after `prompt`."""
    from localmoe.engine.generate import prefill

    cache = model.new_cache(1, len(prompt) + len(tokens) + 8)
    out = [prefill(model, prompt, cache)[0]]
    with torch.inference_mode():
        for t in tokens[:-1]:
            out.append(model.forward(torch.tensor([[t]]), cache)[0, -1])
    return torch.stack(out).double()


def _greedy(model, prompt: list[int], n: int) -> list[int]:
    from localmoe.engine.generate import prefill

    cache = model.new_cache(1, len(prompt) + n + 8)
    logits = prefill(model, prompt, cache)[0]
    out = []
    with torch.inference_mode():
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = model.forward(torch.tensor([[out[-1]]]), cache)[0, -1]
    return out


def _llama(path, threads: int, kv_type: int, n_ctx: int):
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                          logits_all=False, verbose=False, type_k=kv_type, type_v=kv_type)

    def last():
        return torch.from_numpy(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                                      shape=(llm.n_vocab(),)).copy()).double()

    def forced(prompt: list[int], tokens: list[int]) -> torch.Tensor:
        llm.reset()
        llm.eval(prompt)
        out = [last()]
        for t in tokens[:-1]:
            llm.eval([t])
            out.append(last())
        return torch.stack(out)

    def greedy(prompt: list[int], n: int) -> list[int]:
        llm.reset()
        llm.eval(prompt)
        out = []
        for _ in range(n):
            out.append(int(last().argmax()))
            llm.eval([out[-1]])
        return out

    return forced, greedy


def _compare(got: torch.Tensor, want: torch.Tensor) -> str:
    spread = (want.max(-1).values - want.min(-1).values)
    rel = ((got - want).abs().max(-1).values / spread).max().item()
    logp, logq = want.log_softmax(-1), got.log_softmax(-1)
    kl = (logp.exp() * (logp - logq)).sum(-1).mean().item()
    agree = (got.argmax(-1) == want.argmax(-1)).double().mean().item()
    return f"max |diff| {rel:.2e} of the range, mean KL {kl:.2e}, top-1 agree {100 * agree:.1f}%"


def _first_diff(a: list[int], b: list[int]) -> str:
    return next((f"leaves at token {i}" for i, (x, y) in enumerate(zip(a, b)) if x != y), "identical")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--expert-precision", default="q8")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-llama", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from localmoe.default_model import default_model_path

    base = _localmoe(args, "float32")
    prompt = base.chat_prompt([{"role": "user", "content": PROMPT}])
    tokens = _greedy(base.model, prompt, args.tokens)
    print(f"kv_cache_accuracy: embedded model, expert precision {args.expert_precision}, prompt {len(prompt)} "
          f"tokens + {len(tokens)} decoded (teacher-forced)", flush=True)
    runs = {"localmoe fp32": (_teacher_forced(base.model, prompt, tokens), tokens)}
    for dtype in ("bfloat16", "fp8"):
        model = _localmoe(args, dtype).model
        runs[f"localmoe {dtype}"] = (_teacher_forced(model, prompt, tokens), _greedy(model, prompt, args.tokens))
    if not args.no_llama:
        try:
            for name, kv in (("llama.cpp f32", 0), ("llama.cpp f16", 1)):
                forced, greedy = _llama(default_model_path(), args.threads, kv, len(prompt) + args.tokens + 16)
                runs[name] = (forced(prompt, tokens), greedy(prompt, args.tokens))
        except ImportError:
            print("(llama-cpp-python not installed: localmoe only)")
    refs = [name for name in ("localmoe fp32", "llama.cpp f32", "llama.cpp f16") if name in runs]
    for name, (logits, greedy) in runs.items():
        print(f"{name}: greedy {_first_diff(greedy, tokens)} against localmoe fp32's")
        for ref in refs:
            if ref != name:
                print(f"    vs {ref}: {_compare(logits, runs[ref][0])}")


if __name__ == "__main__":
    main()
