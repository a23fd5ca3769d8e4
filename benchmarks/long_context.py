"""Decode cost per token at long context: dense MLA vs DSA (indexer top-k) vs exact top-k selection.

On the "small" generated DeepSeek-V3.2 checkpoint (8 DSA layers, 8 heads, kv_lora_rank 256, index
heads 4 x 64; random weights), for each context length the latent and index-key caches are filled
with random rows (prefilling 64K tokens would take most of an hour on two cores and is not what is
measured) and a few tokens are decoded in three modes:
  dense   the indexer off (index_topk above the context): every layer attends to every cached row
  dsa     the indexer picks TOPK rows per query; attention runs over those rows only
  exact   no indexer; the real attention scores over all rows, keep the TOPK best (`--sparse-topk`)
Then the logit effect of each mode against dense after a real prefill, and probe-recall of the DSA
layers. Run: .venv/bin/python benchmarks/long_context.py [--contexts 4096,16384,65536] [--topk 2048]

`--prefill-memory 16384,65536,131072`: prefill working memory of the "small" generated Kimi K3 instead.
Per context, in a fresh process: the model is loaded (its weight files' pages mapped in, one short
warm-up step run: what RSS counts as "the model"), its latent caches are filled with random rows
up to the context minus one chunk (`--real-prefill`: the whole prompt runs through the model instead;
two cores need hours for 128k), then the last 512-token chunk runs for real. Printed: peak RSS minus
the RSS of the loaded model, the cache's bytes, their ratio (the target: <= 1.3), and the peak extrapolated
linearly to 1M tokens against `localmoe inspect`'s cache figure at 1M.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from localmoe.config import EngineConfig
from localmoe.engine.layers.dsa import DSAttention
from localmoe.load import load_model
from localmoe.testing import write_checkpoint

NO_LIMIT = 1 << 30


def set_mode(model, mode: str, top_k: int) -> None:
    """dense / dsa / exact on every DSA layer (exact: the selector `EngineConfig.sparse_topk` gives dense MLA)."""
    for _, mixer, _, _ in model.layers:
        assert isinstance(mixer, DSAttention)
        mixer.indexer.top_k = top_k if mode == "dsa" else NO_LIMIT
        mixer.sparse_topk = top_k if mode == "exact" else None


def fill(model, cache, length: int, seed: int = 0) -> None:
    """Random latent rows and index keys at positions 0 .. length-1 of every layer, in chunks."""
    g = torch.Generator().manual_seed(seed)
    for i, (_, mixer, _, _) in enumerate(model.layers):
        for start in range(0, length, 8192):
            n = min(8192, length - start)
            cache.layers[i].latent.update(start, torch.randn(1, n, mixer.config.row_dim, generator=g))
            cache.layers[i].index.update(start, torch.randn(1, n, mixer.indexer.head_dim, generator=g))
    cache.offset = length


def decode_ms(model, cache, length: int, steps: int) -> float:
    """Fastest milliseconds per decoded token starting at `length` cached positions (the minimum: the
    CPUs are shared, and contention only ever adds time)."""
    times = []
    token = torch.tensor([[7]])
    for _ in range(steps + 1):  # the first step warms up
        start = time.perf_counter()
        model.forward(token, cache)
        times.append(time.perf_counter() - start)
    cache.trim(length)
    return min(times[1:]) * 1e3


@torch.inference_mode()
def attention_ms(model, cache, length: int, steps: int) -> float:
    """Fastest milliseconds of layer 0's attention alone for one new token at `length` cached positions."""
    from localmoe.engine.step import make_step

    _, mixer, _, _ = model.layers[0]
    x = torch.randn(1, 1, model.spec.hidden_size, generator=torch.Generator().manual_seed(1))
    step = make_step(cache, length, 1, model.rope)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        mixer(x, step, cache.layers[0])
        times.append(time.perf_counter() - start)
        cache.layers[0].trim(length)
    return min(times[1:]) * 1e3


def logit_effect(top_ks: list[int], prompt_len: int) -> dict[int, tuple[float, float]]:
    """Exact top-k (`sparse_topk`) against dense attention on the embedded SmolLM2 (trained, GQA): per
    top-k, (max |logit diff| / max |logit|, greedy-token agreement) over a ~prompt_len-token text."""
    from localmoe.commands.probe_recall import document

    out, dense = {}, None
    for top_k in [None, *top_ks]:
        loaded = load_model(None, EngineConfig(dtype="float32", max_context=2 * prompt_len, sparse_topk=top_k))
        if dense is None:
            text = document(loaded.tokenizer, prompt_len, 0.5, "7481", seed=3)
            tokens = torch.tensor([loaded.tokenizer.encode(text)])
        model = loaded.model
        logits = model.forward(tokens, model.new_cache(1, tokens.shape[1]), all_logits=True)[0]
        if dense is None:
            dense = logits
            continue
        tail, ref = logits[max(top_ks):], dense[max(top_ks):]
        out[top_k] = (((tail - ref).abs().max() / ref.abs().max()).item(),
                      (tail.argmax(-1) == ref.argmax(-1)).float().mean().item())
    return out


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key))


def _libc():
    import ctypes

    return ctypes.CDLL("libc.so.6", use_errno=True)


def _populate(folder: str) -> None:
    """Fault in every page this process maps from files under `folder` (the checkpoint's weights):
    weights are mapped lazily, and a page first touched during the prefill is the model's, not working
    memory (MADV_POPULATE_READ, Linux 5.14+)."""
    import ctypes

    libc = _libc()
    with open("/proc/self/maps") as f:
        spans = [line.split() for line in f]
    for p in spans:
        if len(p) > 5 and p[5].startswith(folder):
            lo, hi = (int(a, 16) for a in p[0].split("-"))
            if libc.madvise(ctypes.c_void_p(lo), ctypes.c_size_t(hi - lo), 22):
                raise OSError(ctypes.get_errno(), f"madvise(MADV_POPULATE_READ) on {p[5]}")


def prefill_memory_worker(path: str, context: int, real: bool, chunk: int = 512) -> None:
    """One context in this (fresh) process: prints a JSON line {context, model, peak, cache} in bytes.

    "model": RSS once the model is loaded, every page of its weight files mapped in, and one 8-token
    step has run in a throwaway cache (the kernels' code, thread pools, lazily built tables); freed
    heap is returned (malloc_trim) before the measure. "peak": the highest RSS above that from the
    cache's allocation to the end of the prefill (the filled rows are counted; the filling's own
    temporaries are returned first)."""
    import json

    from localmoe.engine.state_cache import DeltaStateCache, LatentCache

    model = load_model(path, EngineConfig(dtype="float32", max_context=context), progress=False).model
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.spec.vocab_size, (1, context), generator=g)
    _populate(str(Path(path).resolve()))
    model.forward(tokens[:, :8], model.new_cache(1, 8))
    libc = _libc()
    libc.malloc_trim(0)
    loaded = _status("VmRSS")
    cache = model.new_cache(1, context)
    done = 0 if real else context - chunk
    for layer in cache.layers:
        if isinstance(layer, LatentCache):
            for start in range(0, done, 4096):
                layer.update(start, torch.randn(1, min(4096, done - start), layer.rows.dim, generator=g))
        elif isinstance(layer, DeltaStateCache):
            layer.offset = done
    cache.offset = done
    libc.malloc_trim(0)  # the random rows' temporaries are not the prefill's
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak from here on (the filled rows are in the RSS already)
    began, cpu = time.perf_counter(), time.process_time()
    for start in range(done, context, chunk):
        model.forward(tokens[:, start:start + chunk], cache)
    print(json.dumps({"context": context, "model": loaded, "peak": _status("VmHWM") - loaded,
                      "cache": cache.nbytes(), "seconds": time.perf_counter() - began,
                      "cpu": time.process_time() - cpu}), flush=True)


def prefill_memory(contexts: list[int], real: bool) -> None:
    """The table and the 1M extrapolation (see the module docstring), one fresh process per context."""
    import json
    import subprocess
    import sys

    from localmoe.describe import describe_model

    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint("kimi_k3", Path(tmp) / "small", "small", seed=0)
        at_1m = describe_model(path, EngineConfig(dtype="float32"))["memory"]["kv_cache"]["float32"]
        print(f"prefill working memory, small kimi_k3 (random weights), fp32 cache, chunks of 512, "
              f"{'real prefill' if real else 'cache filled, last chunk real'}, {torch.get_num_threads()} threads")
        print(f"{'context':>8} {'peak RSS - model':>17} {'cache':>10} {'ratio':>6} {'chunk s':>8} {'CPU s':>7}")
        rows = []
        for context in contexts:
            args = [sys.executable, __file__, "--prefill-memory-worker", str(path), str(context),
                    "--threads", str(torch.get_num_threads())]
            out = subprocess.run(args + (["--real-prefill"] if real else []), capture_output=True, text=True,
                                 check=False)
            if out.returncode:
                raise SystemExit(f"context {context}: the worker failed:\n{out.stderr[-2000:]}")
            row = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append(row)
            print(f"{context:>8} {row['peak'] / 2**20:>13.1f} MiB {row['cache'] / 2**20:>6.1f} MiB "
                  f"{row['peak'] / row['cache']:>6.2f} {row['seconds']:>8.1f} {row['cpu']:>7.1f}", flush=True)
        if len(rows) >= 2:
            x = torch.tensor([float(r["context"]) for r in rows])
            y = torch.tensor([float(r["peak"]) for r in rows])
            slope = ((x - x.mean()) * (y - y.mean())).sum() / ((x - x.mean()) ** 2).sum()
            at = y.mean() + slope * (2 ** 20 - x.mean())
            print(f"extrapolated to 1M tokens: peak RSS - model {at / 2**30:.2f} GiB ({slope:.0f} B per token) "
                  f"against inspect's {at_1m['total_at_1m_tokens'] / 2**30:.2f} GiB of cache "
                  f"({at_1m['bytes_per_token']} B per token): ratio {at / at_1m['total_at_1m_tokens']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill-memory", default="", help="contexts for the K3 prefill-memory table instead")
    parser.add_argument("--real-prefill", action="store_true", help="with --prefill-memory: prefill every token")
    parser.add_argument("--prefill-memory-worker", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("--contexts", default="4096,16384,65536")
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--effect-prompt", type=int, default=1024, help="text length for the logit effect")
    parser.add_argument("--probe-topk", type=int, default=128, help="DSA top-k for probe-recall (< its 1024 tokens)")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.prefill_memory_worker:
        return prefill_memory_worker(args.prefill_memory_worker[0], int(args.prefill_memory_worker[1]),
                                     args.real_prefill)
    if args.prefill_memory:
        return prefill_memory([int(c) for c in args.prefill_memory.split(",")], args.real_prefill)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint("deepseek_v32", Path(tmp) / "small", "small", seed=0)
        loaded = load_model(path, EngineConfig(dtype="float32", max_context=max(contexts) + 16), progress=False)
        model = loaded.model
        print(f"decode ms/token, {model.spec.num_layers} DSA layers, small deepseek_v32 (random weights), "
              f"top-k {args.topk}, {torch.get_num_threads()} threads")
        print(f"{'context':>8} {'dense':>9} {'dsa':>9} {'exact':>9}  dsa/dense exact/dense | one layer's attention: "
              f"{'dense':>7} {'dsa':>7} {'exact':>7}")
        for length in contexts:
            cache = model.new_cache(1, length + 16)
            fill(model, cache, length)
            row, attn = {}, {}
            for mode in ("dense", "dsa", "exact"):
                set_mode(model, mode, args.topk)
                row[mode] = decode_ms(model, cache, length, args.steps)
                attn[mode] = attention_ms(model, cache, length, 2 * args.steps)
            print(f"{length:>8} {row['dense']:>9.1f} {row['dsa']:>9.1f} {row['exact']:>9.1f}  "
                  f"{row['dsa'] / row['dense']:>9.2f} {row['exact'] / row['dense']:>11.2f} | "
                  f"{'':>22}{attn['dense']:>7.2f} {attn['dsa']:>7.2f} {attn['exact']:>7.2f}", flush=True)
            del cache
        effect = logit_effect([32, 128, 512], args.effect_prompt)
        print(f"logit effect of --sparse-topk vs dense on SmolLM2-135M (trained), {args.effect_prompt}-token text, "
              f"positions past the first 512:")
        for top_k, (rel, agree) in effect.items():
            print(f"  top-{top_k:<4} max |diff| {rel:.2%} of max |logit|, greedy token agrees at {agree:.1%}")
        from localmoe.commands.probe_recall import probe, report

        set_mode(model, "dsa", args.probe_topk)
        print(f"probe-recall, DSA top-k {args.probe_topk}, ~1024-token document (random weights: answers are noise):")
        print(report(probe(loaded, [0.1, 0.5, 0.9], 1024, max_tokens=2)))


if __name__ == "__main__":
    main()
