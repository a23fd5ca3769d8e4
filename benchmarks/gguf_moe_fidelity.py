"""MoE GGUFs written by llama.cpp's own converter, loaded by localmoe, against the HF checkpoint they came from.

For each family, the generated tiny checkpoint (`localmoe.testing`) is converted by `convert_hf_to_gguf.py`
from the llama-cpp-python sdist (fetched with `pip download` unless --llama-src names an unpacked one; the
test tokenizer's pre-tokenizer hash, unknown to the converter, is mapped to `gpt-2`, and DeepSeek-V3.2's
vocabulary check is skipped: both only touch tokenizer metadata). localmoe then loads the GGUF and the
reference: the HF checkpoint itself for f32 / bf16 (a lossless conversion of the bf16 weights), the HF
checkpoint with the GGUF's values decoded by `gguf.quants.dequantize` for q8_0
(`localmoe.testing.moe_gguf.write_dequantized`). Printed per (family, outtype): whether the ModelSpec from
the GGUF metadata equals the one from config.json, the largest logit difference over a 16-token prefill and
8 greedy decode steps relative to the logit range (expert precision exact, fp32), whether the tokenizers
agree, and how llama.cpp's tensor names and shapes compare with `localmoe.testing.moe_gguf`'s writer (the
layout the CI tests use). Not run in CI: it needs the sdist and its converter's dependencies (transformers).

    python benchmarks/gguf_moe_fidelity.py [--families qwen3_moe,deepseek_v3,deepseek_v32,glm_moe_dsa,kimi_linear,kimi_k3,glm5_next]
                                           [--outtypes f32,bf16,q8_0] [--work DIR] [--llama-src DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys
import tempfile
from pathlib import Path

from k3_cpu import llama_src

CONVERT = """import sys, runpy
sys.path[:0] = [{gguf_py!r}, {src!r}]
import conversion.base as base
import conversion.deepseek as deepseek
for cls in list(vars(base).values()):  # the generated tokenizer's pre-tokenizer hash is not in llama.cpp's table
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
# V3.2 asserts the transformers tokenizer's add_bos_token attribute, which transformers 5 no longer exposes
deepseek.DeepseekV32Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""
FAMILIES = ("qwen3_moe", "deepseek_v3", "deepseek_v32", "glm_moe_dsa", "kimi_linear", "qwen3_next", "kimi_k3",
            "glm5_next")
EXTRA_ARGS = {"qwen3_next": ["--no-mtp"]}  # the generated Qwen3-Next has no MTP block (the converter expects one)
TOLERANCE = 1e-5  # of the logit range (issue 24's acceptance)


def converter_fields(hf: Path) -> None:
    """glm5_next: llama.cpp's Glm5NextModel asserts `mla_use_nope` and reads `first_k_dense_replace`, which the
    released config carries and transformers' Glm5NextConfig (and so the generated one) does not: add both,
    derived from the config (NoPE MLA, the leading dense layers of `mlp_layer_types`)."""
    import json

    config = json.loads((hf / "config.json").read_text())
    text = config.get("text_config", {})
    if config.get("model_type") == "glm5_next" and "first_k_dense_replace" not in text:
        text |= {"mla_use_nope": True, "first_k_dense_replace": text["mlp_layer_types"].index("sparse")}
        (hf / "config.json").write_text(json.dumps(config, indent=2))


def convert(src: Path, hf: Path, outtype: str, out: Path) -> None:
    code = CONVERT.format(gguf_py=str(src / "gguf-py"), src=str(src), script=str(src / "convert_hf_to_gguf.py"))
    extra = EXTRA_ARGS.get(hf.name, [])
    done = subprocess.run([sys.executable, "-c", code, str(hf), "--outtype", outtype, "--outfile", str(out), *extra],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp's converter failed on {hf.name} ({outtype}):\n{done.stderr[-3000:]}")


def run(model, tokens, steps: int = 8):
    cache = model.new_cache(1, tokens.shape[1] + steps + 1)
    out = [model.forward(tokens, cache, all_logits=True)]
    for _ in range(steps):
        out.append(model.forward(out[-1][:, -1:].argmax(-1), cache))
    return out


def layout(path: Path) -> dict[str, tuple[int, ...]]:
    from localmoe.store.gguf_split import open_gguf

    with open_gguf(path) as f:
        return {n: f.info(n).shape for n in f.tensor_names()}


def check(family: str, outtype: str, work: Path, src: Path) -> dict:
    import torch

    from localmoe.config import EngineConfig
    from localmoe.load import load_model
    from localmoe.testing import write_checkpoint
    from localmoe.testing.moe_gguf import write_dequantized, write_moe_gguf

    hf = work / family
    if not (hf / "config.json").exists():
        write_checkpoint(family, hf, "tiny", seed=0)
        converter_fields(hf)
    gguf = work / f"{family}.{outtype}.gguf"
    if not gguf.exists():
        convert(src, hf, outtype, gguf)
    reference = hf if outtype in ("f32", "bf16") else write_dequantized(hf, gguf, work / f"{family}.{outtype}.ref")
    config = EngineConfig(dtype="float32", expert_precision="exact")
    ours, ref = load_model(gguf, config, progress=False), load_model(reference, config, progress=False)
    tokens = torch.randint(10, 600, (1, 16), generator=torch.Generator().manual_seed(0))
    diff = 0.0
    for a, b in zip(run(ours.model, tokens), run(ref.model, tokens)):
        diff = max(diff, ((a - b).abs().max() / (b.max() - b.min())).item())
    text = "Hello world, the capital of France is Paris. 2026!"
    mine = write_moe_gguf(hf, work / f"{family}.{outtype}.localmoe.gguf", "f32" if outtype == "q8_0" else outtype)
    theirs, ours_layout = layout(gguf), layout(mine)
    return {"spec": dataclasses.replace(ours.spec, name="") == dataclasses.replace(ref.spec, name=""),
            "diff": diff, "tokenizer": ours.tokenizer.encode(text) == ref.tokenizer.encode(text),
            "only_llama_cpp": sorted(set(theirs) - set(ours_layout)),
            "only_ours": sorted(set(ours_layout) - set(theirs)),
            "shapes_differ": sorted(n for n in set(theirs) & set(ours_layout) if theirs[n] != ours_layout[n])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--outtypes", default="f32,bf16,q8_0")
    parser.add_argument("--work", help="folder for the checkpoints and GGUFs (default: a temporary one)")
    parser.add_argument("--llama-src", help="an unpacked llama.cpp source folder with convert_hf_to_gguf.py")
    args = parser.parse_args()
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gguf_moe_fidelity_"))
    work.mkdir(parents=True, exist_ok=True)
    src = llama_src(work, args.llama_src)
    failed = 0
    print(f"{'family':<14}{'outtype':<8}{'spec':<6}{'max |diff| / range':>20}  {'tokens':<7}layout vs localmoe.testing")
    for family in args.families.split(","):
        for outtype in args.outtypes.split(","):
            r = check(family, outtype, work, src)
            same = not (r["only_llama_cpp"] or r["only_ours"] or r["shapes_differ"])
            ok = r["spec"] and r["diff"] <= TOLERANCE and r["tokenizer"]
            failed += not ok
            extra = "same names and shapes" if same else (f"only llama.cpp {r['only_llama_cpp'][:4]}, only ours "
                                                          f"{r['only_ours'][:4]}, shapes {r['shapes_differ'][:4]}")
            print(f"{family:<14}{outtype:<8}{r['spec']!s:<6}{r['diff']:>20.2e}  {r['tokenizer']!s:<7}{extra}"
                  f"{'' if ok else '  FAIL'}")
    print(f"{'all within' if not failed else f'{failed} outside'} {TOLERANCE:g} of the logit range")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
