"""MoE GGUFs quantised by llama.cpp's own quantiser (llama-quantize's per-tensor mixes, real blocks rather than
the CI tests' random ones), loaded by localmoe, against the same weights dequantised by `gguf.quants` and
against llama.cpp running the file.

The generated tiny checkpoint (`localmoe.testing`) is written as an F32 GGUF in llama.cpp's layout
(`localmoe.testing.moe_gguf`), then quantised by llama-cpp-python's `llama_model_quantize` to each file type.
Printed per type: the ggml types in the file, localmoe's largest logit difference over an 8-token prefill and
4 greedy decode steps against the dequantised twin (relative to the logit range; expert precision exact, fp32),
and against llama.cpp's own prefill logits (correlation, argmax agreement; llama.cpp rounds activations to
int8 for its dot products, so these are not bit-level). Types llama-quantize refuses without an importance
matrix (IQ1_*, IQ2_*, IQ3_XXS) are reported as refused. Not run in CI: it needs llama-cpp-python.

    python benchmarks/gguf_quant_fidelity.py [--families qwen3_moe,glm4_moe]
                                             [--types Q2_K,Q3_K_M,IQ3_S,IQ3_M,TQ1_0,TQ2_0,IQ4_XS,IQ2_M] [--work DIR]
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
from pathlib import Path

from gguf_moe_fidelity import run

TYPES = "Q2_K,Q3_K_M,IQ3_S,IQ3_M,IQ3_XXS,IQ2_M,IQ2_XXS,IQ1_M,TQ1_0,TQ2_0,IQ4_XS"
PROMPT = [5, 17, 3, 99, 42, 7, 250, 11]


def quantize(src: Path, dst: Path, ftype: str) -> bool:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) == 0


def check(family: str, ftype: str, work: Path) -> str:
    import llama_cpp
    import numpy as np
    import torch

    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.store.gguf import GGUFFile
    from localmoe.testing import write_checkpoint
    from localmoe.testing.moe_gguf import write_dequantized, write_moe_gguf

    src, f32 = work / family, work / f"{family}.f32.gguf"
    if not (src / "config.json").exists():
        write_checkpoint(family, src, size="tiny", seed=3)
    if not f32.exists():
        write_moe_gguf(src, f32, "f32")
    path = work / f"{family}.{ftype}.gguf"
    if not quantize(f32, path, ftype):
        return "refused by llama-quantize (needs an importance matrix)"
    f = GGUFFile(path)
    kinds = sorted({f.info(n).ggml_type.name for n in f.tensor_names()})
    config = EngineConfig(dtype="float32", expert_precision="exact")
    tokens = torch.tensor([PROMPT])
    ours = run(load_model(path, config, progress=False).model, tokens, 4)
    twin = run(load_model(write_dequantized(src, path, work / f"{family}.{ftype}.twin"), config,
                          progress=False).model, tokens, 4)
    rel = max(((a - b).abs().max() / (b.max() - b.min())).item() for a, b in zip(ours, twin))
    llm = llama_cpp.Llama(str(path), n_ctx=64, logits_all=True, verbose=False, n_threads=1)
    llm.eval(PROMPT)
    theirs, mine = np.array(llm.scores[:len(PROMPT)]), ours[0][0].numpy()
    corr = np.corrcoef(theirs.ravel(), mine.ravel())[0, 1]
    agree = (theirs.argmax(-1) == mine.argmax(-1)).mean()
    return f"{', '.join(kinds)}; twin {rel:.1e}; llama.cpp corr {corr:.5f}, argmax {agree:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default="qwen3_moe,glm4_moe")
    parser.add_argument("--types", default=TYPES)
    parser.add_argument("--work", help="folder for the checkpoints and GGUFs (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gguf_quant_fidelity_"))
    work.mkdir(parents=True, exist_ok=True)
    for family in args.families.split(","):
        for ftype in args.types.split(","):
            print(f"{family:<11}{ftype:<9}{check(family, ftype, work)}", flush=True)


if __name__ == "__main__":
    main()
