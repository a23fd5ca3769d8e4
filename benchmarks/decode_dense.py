"""Decode speed of the embedded dense model: localmoe vs transformers (and llama.cpp if installed).

The peers run on the same GGUF, with the same thread count, greedy, after the same prompt. localmoe
and llama.cpp alternate in separate processes for `--pairs` rounds (benchmarks/alternate.py: the median
of the per-round ratios); transformers runs once in this process. Prints tokens/s, ratios, the
fraction of the memory-bandwidth limit reached, and localmoe's Python/dispatch overhead per token
(measured by running the same layer graph with tiny matrices, so that nearly all remaining time is
overhead).

    python benchmarks/decode_dense.py [--tokens 64] [--threads 2] [--pairs 4] [--skip-transformers] [--quant q4_k_m]
                                      [--cpu-time]

An AVX2-only comparison on an AVX-512 host: LOCALMOE_CPU_ISA=avx2 for localmoe, and LLAMA_CPP_LIB_PATH naming a
llama.cpp built with GGML_NATIVE=OFF GGML_AVX2=ON GGML_AVX512=OFF (llama-cpp-python loads that library).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from pathlib import Path

import torch
from alternate import alternate, emit, median_ratio
from common import memory_read_bandwidth, report

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def time_localmoe(loaded, prompt_ids: list[int], tokens: int, clock=time.perf_counter) -> tuple[float, list[int]]:
    from localmoe.engine.generate import prefill
    from localmoe.engine.sampler import SamplingParams, sample

    model = loaded.model
    cache = model.new_cache(1, len(prompt_ids) + tokens + 8)
    logits = prefill(model, prompt_ids, cache)
    greedy = SamplingParams(temperature=0)
    out = []
    start = clock()
    for _ in range(tokens):
        token = sample(logits, greedy)
        out.append(int(token))
        logits = model.forward(token.view(1, 1), cache)[:, -1]
    return tokens / (clock() - start), out


def overhead_per_token(loaded, tokens: int) -> float:
    """Seconds per decode step of the same layer graph with 16-wide matrices (≈ pure overhead)."""
    from localmoe.config import EngineConfig
    from localmoe.engine.transformer import Transformer
    from localmoe.models import family_for_model_type

    spec = dataclasses.replace(loaded.spec, hidden_size=16, num_heads=loaded.spec.num_heads // loaded.spec.num_kv_heads,
                               num_kv_heads=1, head_dim=16, intermediate_size=16, vocab_size=64)
    family = family_for_model_type("llama")
    weights = {name: torch.randn(shape) * 0.1 for name, shape in family.expected_shapes(spec).items()}
    tiny = Transformer(spec, weights, EngineConfig(dtype="float32"))
    rate, _ = time_localmoe(type("L", (), {"model": tiny})(), [1, 2, 3], tokens)
    return 1.0 / rate


def time_transformers(gguf_path, prompt_ids: list[int], tokens: int) -> tuple[float, list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name,
                                                 dtype=torch.float32).eval()
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = model(ids, use_cache=True)
        past, logits = out.past_key_values, out.logits[:, -1]
        generated = []
        start = time.perf_counter()
        for _ in range(tokens):
            token = logits.argmax(-1, keepdim=True)
            generated.append(int(token))
            out = model(token, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1]
        elapsed = time.perf_counter() - start
    return tokens / elapsed, generated


def time_llama_cpp(gguf_path, prompt_ids: list[int], tokens: int, threads: int,
                   clock=time.perf_counter) -> tuple[float, list[int]]:
    import llama_cpp
    import numpy as np

    llm = llama_cpp.Llama(model_path=str(gguf_path), n_threads=threads, n_threads_batch=threads, n_ctx=1024,
                          logits_all=False, verbose=False)

    def last_logits():  # Llama.scores holds logits only with logits_all: read the context's own
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    llm.eval(prompt_ids)
    generated = []
    start = clock()
    for _ in range(tokens):
        token = int(np.argmax(last_logits()))
        generated.append(token)
        llm.eval([token])
    return tokens / (clock() - start), generated


def worker(args) -> None:
    """One timed run in this process (the parent alternates these): RESULT {"decode": tok/s, "tokens": [...]}."""
    prompt_ids = [int(t) for t in args.prompt_ids.split(",")]
    clock = time.process_time if args.cpu_time else time.perf_counter
    if args.worker == "llama":
        time_llama_cpp(args.path, prompt_ids, 8, args.threads)  # warm up
        rate, tokens = time_llama_cpp(args.path, prompt_ids, args.tokens, args.threads, clock)
    else:
        from localmoe.load import load_model

        loaded = load_model(Path(args.path), threads=args.threads, dtype=args.dtype, progress=False)
        time_localmoe(loaded, prompt_ids, 8)  # warm up
        rate, tokens = time_localmoe(loaded, prompt_ids, args.tokens, clock)
    emit({"decode": rate, "tokens": tokens})


QUANTS = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "q5_k_m": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
          "q6_k": "LLAMA_FTYPE_MOSTLY_Q6_K", "q8_0": "LLAMA_FTYPE_MOSTLY_Q8_0"}


def requantised(src, quant: str, out=None):
    """`src` requantised to `quant` by llama.cpp (cached beside it, or at `out`). SmolLM2's 576-wide rows are not
    whole 256-value super-blocks, so llama.cpp falls back to Q5_0 / Q8_0 there, as it does in such files."""
    import ctypes

    import llama_cpp

    out = out or src.with_name(f"{src.stem.rsplit('.', 1)[0]}.{quant.upper()}.gguf")
    if not out.exists():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = getattr(llama_cpp, QUANTS[quant]), True
        tmp = out.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
            raise SystemExit(f"llama.cpp could not quantise {src} to {quant}")
        tmp.rename(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--pairs", type=int, default=4, help="alternating localmoe / llama.cpp rounds")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--cpu-time", action="store_true", help="the peers' rates by the CPU time of their process "
                        "(all threads) instead of the wall clock: on a loaded machine, with --threads 1")
    parser.add_argument("--quant", choices=sorted(QUANTS), help="decode the default model requantised by "
                        "llama.cpp's own quantiser to this type (needs llama-cpp-python): a real K-quant file")
    parser.add_argument("--worker", choices=("localmoe", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--prompt-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.worker:
        worker(args)
        return

    from localmoe.default_model import default_model_path
    from localmoe.load import load_model

    gguf_path = default_model_path() if args.quant is None else requantised(default_model_path(), args.quant)
    print(f"decode_dense: {gguf_path.name}, {args.tokens} greedy tokens, {args.threads} threads", flush=True)
    loaded = load_model(gguf_path, threads=args.threads, dtype=args.dtype, progress=False)
    prompt_ids = loaded.chat_prompt([{"role": "user", "content": PROMPT}])
    time_localmoe(loaded, prompt_ids, 8)  # warm up
    ours, our_tokens = time_localmoe(loaded, prompt_ids, args.tokens)
    overhead = overhead_per_token(loaded, args.tokens)
    bandwidth = memory_read_bandwidth()
    model = loaded.model  # the embedding is gathered, not read (unless it is the tied head's blocks)
    weight_bytes = model.weight_bytes() - (0 if model.head_shares_embedding() else model.embed.nbytes)
    limit = bandwidth / weight_bytes
    rows = [("localmoe", f"{ours:.1f} tokens/s ({args.dtype} weights, {weight_bytes / 2**20:.0f} MiB read per token)"),
            ("memory bandwidth", (f"{bandwidth / 1e9:.1f} GB/s -> limit {limit:.1f} tokens/s; localmoe at "
                                 f"{ours / limit:.2f} of it")),
            ("python overhead", f"{overhead * 1e3:.2f} ms/token = {overhead * ours:.0%} of a localmoe step")]
    if not args.skip_transformers:
        print("loading transformers on the same GGUF (about a minute) ...", flush=True)
        theirs, their_tokens = time_transformers(gguf_path, prompt_ids, args.tokens)
        same = sum(a == b for a, b in zip(our_tokens, their_tokens))
        rows += [("transformers", f"{theirs:.1f} tokens/s"),
                 ("localmoe / transformers", (f"{ours / theirs:.2f}x (goal >= 3x); greedy tokens equal: "
                                             f"{same}/{args.tokens}"))]
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        rows.append(("llama.cpp", "not installed (pip install llama-cpp-python to compare)"))
    else:
        common = ["--path", str(gguf_path), "--threads", str(args.threads), "--tokens", str(args.tokens),
                  "--dtype", args.dtype, "--prompt-ids", ",".join(map(str, prompt_ids)), *(["--cpu-time"] * args.cpu_time)]
        me = str(Path(__file__).resolve())
        res = alternate({"localmoe": [me, "--worker", "localmoe", *common], "llama.cpp": [me, "--worker", "llama", *common]},
                        args.pairs)
        ours_runs, cpp_runs = [r["decode"] for r in res["localmoe"]], [r["decode"] for r in res["llama.cpp"]]
        same = sum(a == b for a, b in zip(res["localmoe"][0]["tokens"], res["llama.cpp"][0]["tokens"]))
        rows += [("alternating rounds", ", ".join(f"{a:.1f} vs {b:.1f}" for a, b in zip(ours_runs, cpp_runs))),
                 ("llama.cpp", f"{statistics.median(cpp_runs):.1f} tokens/s (median of {args.pairs})"),
                 ("localmoe / llama.cpp", (f"{median_ratio(ours_runs, cpp_runs):.2f}x (median of the rounds' ratios); "
                                          f"greedy tokens equal: {same}/{args.tokens}"))]
    report(rows)


if __name__ == "__main__":
    main()
