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
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from localmoe.config import EngineConfig
from localmoe.engine.dsa import DSAttention
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
