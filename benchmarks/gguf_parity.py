"""Check that llama.cpp runs the same model as localmoe on a generated gpt_oss checkpoint.

    python benchmarks/gguf_parity.py [--size tiny|small] [--experts mxfp4|f32|both] [--work DIR] [--tokens N]

Writes the checkpoint and its GGUF (localmoe.testing.gpt_oss_gguf.write_gguf), then prints, for a few
prompts (one token, short, longer than the sliding window), the correlation of localmoe's and
llama.cpp's (llama-cpp-python) last-position logits and max |diff| over the logit range, and a
greedy run of N tokens from each engine (positions where they differ, with localmoe's top-2
margin there: random weights can have near-ties).

The MXFP4 GGUF (what benchmarks/offload.py runs): llama.cpp's CPU MXFP4 matmul rounds its
activations to Q8_0 (8-bit, per 32 values), as localmoe's default expert precision q8 does, so
localmoe runs at q8 against it (the roundings are not bit-identical: on random weights knife-edge
top-k choices can still differ). The F32-experts GGUF holds the same weights dequantised exactly,
no rounding on either side (localmoe at expert precision exact), so it checks the
export itself (names, layouts, biases, metadata); the MXFP4 repack is checked byte-exactly
against gguf-py's dequantiser here as well. What remains with F32 experts is ggml's YaRN: it
floors/ceils the correction range (gpt-oss: truncate=False, no GGUF key for it); --llama-yarn
runs localmoe with that rounding to show the rest agrees to float32 noise.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _engines(src: Path, gguf: Path, threads: int, n_ctx: int, llama_yarn: bool = False, precision: str = "q8"):
    import torch
    from llama_cpp import Llama, llama_get_logits_ith

    from localmoe.config import EngineConfig
    from localmoe.load import load_model

    torch.set_num_threads(threads)
    config = EngineConfig(dtype="float32", threads=threads, expert_precision=precision)
    model = load_model(src, config, progress=False).model
    if llama_yarn:  # ggml floors/ceils YaRN's correction range; gpt-oss asks for truncate=False
        from localmoe.engine.rope import RotaryTable

        spec = model.spec
        model.rope = RotaryTable(spec.head_dim, spec.rope_theta, {**spec.rope_scaling, "truncate": True},
                                 model.max_context)
    # F32 KV cache: llama.cpp's default F16 cache rounds keys/values (GGML_TYPE_F32 == 0)
    llm = Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_batch=n_ctx, verbose=False,
                type_k=0, type_v=0)

    def ours(tokens: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model.forward(torch.tensor([tokens]), model.new_cache(1, n_ctx))[0, -1].double().numpy()

    def theirs(tokens: list[int]) -> np.ndarray:
        llm.reset()
        llm.eval(tokens)
        ptr = llama_get_logits_ith(llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float64)

    return ours, theirs


def compare(src: Path, gguf: Path, tokens: int = 32, threads: int = 2, window: int = 128,
            llama_yarn: bool = False, precision: str = "q8") -> dict:
    """Print and return {prompt label: (corr, maxdiff/range)} and the greedy agreement."""
    rng = np.random.default_rng(0)
    long = [int(t) for t in rng.integers(3, 600, window + 8)]
    prompts = {"1 token": [17], "4 tokens": [17, 230, 5, 99], f"{len(long)} tokens": long}
    ours, theirs = _engines(src, gguf, threads, max(256, len(long) + tokens + 8), llama_yarn, precision)
    out = {}
    for label, p in prompts.items():
        a, b = ours(p), theirs(p)
        corr = float(np.corrcoef(a, b)[0, 1])
        rel = float(np.abs(a - b).max() / (a.max() - a.min()))
        out[label] = (corr, rel)
        print(f"{label:>12}: corr {corr:.6f}  max|diff|/range {rel:.2e}  argmax {a.argmax()} / {b.argmax()}")
    seq_a, seq_b = list(prompts["4 tokens"]), list(prompts["4 tokens"])
    forced, first = 0, None  # forced: steps where both agree on ours' greedy sequence
    for step in range(tokens):  # full re-forward each step: the comparison, not the speed, matters
        a, b = ours(seq_a), theirs(seq_b if first is None else seq_a)
        if a.argmax() == b.argmax():
            forced += 1
        elif first is None:
            top = np.sort(a)[-2:]
            first = (step, float(top[1] - top[0]), float(a[b.argmax()] - top[1]), float(a.max() - a.min()))
        seq_a.append(int(a.argmax()))
        seq_b.append(int(b.argmax()))
    ident = tokens if first is None else first[0]
    print(f"greedy {tokens} tokens: identical prefix {ident}/{tokens}"
          + ("" if first is None else f" (step {first[0]}: ours' top-2 margin {first[1]:.4f} of range "
                                     f"{first[3]:.2f}; llama.cpp's pick {-first[2]:.4f} below ours' top)")
          + f"; argmax agreement on ours' sequence {forced}/{tokens}")
    out["greedy"] = (ident, forced, tokens, first)
    return out


def repack_error(src: Path, gguf_path: Path) -> float:
    """Max |diff| between gguf-py's dequantisation of every expert tensor and the checkpoint's."""
    import gguf

    from localmoe.store.safetensors import SafetensorsCheckpoint
    from localmoe.testing.gpt_oss_gguf import _dequantized

    ckpt = SafetensorsCheckpoint(src)
    worst = 0.0
    for t in gguf.GGUFReader(gguf_path).tensors:
        if not t.name.endswith("_exps.weight"):
            continue
        i, kind = t.name.split(".")[1], t.name.split(".")[2][4:-5]  # blk.{i}.ffn_{gate|up|down}_exps.weight
        e = f"model.layers.{i}.mlp.experts.{'down_proj' if kind == 'down' else 'gate_up_proj'}_"
        rows = slice(None) if kind == "down" else slice(0 if kind == "gate" else 1, None, 2)
        ref = _dequantized(ckpt.tensor(e + "blocks")[:, rows].numpy(), ckpt.tensor(e + "scales")[:, rows].numpy())
        got = gguf.quants.dequantize(t.data, t.tensor_type)
        worst = max(worst, float(np.abs(got.reshape(ref.shape) - ref).max()))
    return worst


def main() -> None:
    import json

    from localmoe.testing import write_checkpoint
    from localmoe.testing.gpt_oss_gguf import write_gguf

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", choices=("tiny", "small"), default="tiny")
    ap.add_argument("--work", type=Path, help="directory for the checkpoint and GGUF (default: a temp dir)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--experts", choices=("mxfp4", "f32", "both"), default="both")
    ap.add_argument("--llama-yarn", action="store_true",
                    help="run localmoe with ggml's integer YaRN correction range (isolates that convention)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf_parity_"))
    src = work / f"gpt_oss_{args.size}"
    if not (src / "config.json").exists():
        write_checkpoint("gpt_oss", src, args.size, seed=0)
    window = json.loads((src / "config.json").read_text())["sliding_window"]
    for experts in ("mxfp4", "f32") if args.experts == "both" else (args.experts,):
        gguf = write_gguf(src, work / f"gpt_oss_{args.size}_{experts}.gguf", experts=experts)
        print(f"--- {gguf.name}")
        if experts == "mxfp4":
            print(f"MXFP4 repack vs gguf-py dequantiser: max |diff| {repack_error(src, gguf):.1e}")
        compare(src, gguf, args.tokens, args.threads, window, args.llama_yarn, "q8" if experts == "mxfp4" else "exact")


if __name__ == "__main__":
    main()
