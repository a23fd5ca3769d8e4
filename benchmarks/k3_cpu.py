"""Kimi K3 (and Kimi-Linear, Qwen3-Next) decode and prefill on the CPU: localmoe against llama.cpp on the same weights.

Each model is a generated random checkpoint (`localmoe.testing`, real layout), converted to GGUF by llama.cpp's
own `convert_hf_to_gguf.py` from the llama-cpp-python sdist (fetched with `pip download` unless --llama-src
names an unpacked one; it needs the `gguf` package, and the test tokenizer's pre-tokenizer hash, unknown to
the converter, is mapped to `gpt-2`: it only touches tokenizer metadata). localmoe runs the HF checkpoint,
llama.cpp (llama-cpp-python) the GGUF: f32 dense weights in both (or bf16 with --dtype bf16), the same MXFP4
experts, the same threads, greedy. The generated checkpoints are bf16, so their f32 values are exactly bf16: localmoe
keeps such weights as bf16 (engine/linear.py `holds_bf16`, checked per tensor; the same bits in every product), and
the roofline line gives each engine's own bytes per token. The engines alternate in separate processes (benchmarks/alternate.py),
`--pairs` rounds (each engine process times `--prefills` prefills of the prompt from an empty cache, their median its
prefill figure, then the decode); printed per round and as medians: prefill and decode tokens/s, localmoe / llama.cpp,
the fraction of the memory bandwidth (weight bytes read per decode token over a read bandwidth measured
after every round) and how far the two engines' logits differ (max |diff| over the logit range; llama.cpp's
KV cache at f32), at every prompt position (each engine in a process of its own, after the timed rounds).

The logits agreement is judged on a twin of the GGUF whose MXFP4 experts are dequantised to F32
(`--twin-limit` bounds its size; K3 `small`'s is 1.2 GB): the same function as the MXFP4 model at exact
precision, which both engines then compute with fp32 activations. On the MXFP4 file itself both engines
round the experts' activations to int8 per 32 values, a discontinuous step: on a random K3 a 1e-7 relative
change of the embeddings already moves localmoe's own logits by ~5e-3 of the range (1e-5 for a 1e-6 change
at exact precision), so two correct engines that sum in different orders need not agree to 1e-3 there; that
figure is printed for information. Routing can still split on near-ties: where the k-th and (k+1)-th router
selection scores are closer than the engines' float differences, they may pick different experts, and every
later position differs through the caches. localmoe records each position's smallest router margin (over the
MoE layers), the check covers the positions before the first margin under --tie-margin, and the report names
the first position off by more than 1e-3 and its margin (a large margin there is a real disagreement).

    python benchmarks/k3_cpu.py [--models kimi_k3:small,kimi_linear:small] [--threads 2] [--pairs 4]
                                [--prompt 72] [--decode 64] [--dtype f32|bf16] [--work DIR]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np
from alternate import alternate, emit, median_ratio

LLAMA_CPP_VERSION = "0.3.36"
CONVERT_ARGS = {"qwen3_next": ["--no-mtp"]}  # the generated Qwen3-Next has no MTP layer (the converter assumes one)
CONVERT = """import sys, runpy
sys.path[:0] = [{gguf_py!r}, {src!r}]
import conversion.base as base
for cls in list(vars(base).values()):  # the generated tokenizer's pre-tokenizer hash is not in llama.cpp's table
    if isinstance(cls, type) and "get_vocab_base_pre" in vars(cls):
        cls.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
"""


def prompt_ids(n: int) -> list[int]:
    rng = random.Random(0)
    return [rng.randrange(10, 600) for _ in range(n)]  # inside the 640-token test tokenizer


def llama_src(work: Path, given: str | None) -> Path:
    """The vendored llama.cpp folder of the llama-cpp-python sdist (downloaded and unpacked once into `work`)."""
    if given:
        return Path(given)
    root = work / f"llama_cpp_python-{LLAMA_CPP_VERSION}"
    if not (root / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py").exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"llama-cpp-python=={LLAMA_CPP_VERSION}", "-d", str(work)], check=True)
        with tarfile.open(work / f"llama_cpp_python-{LLAMA_CPP_VERSION}.tar.gz") as tar:
            wanted = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name and (
                m.name.endswith("convert_hf_to_gguf.py") or "/gguf-py/" in m.name or "/conversion/" in m.name)]
            tar.extractall(work, members=wanted, filter="data")
    return root / "vendor" / "llama.cpp"


def prepare(family: str, size: str, dtype: str, work: Path, src: Path) -> tuple[Path, Path]:
    """(HF checkpoint, GGUF of it by llama.cpp's converter), made once in `work`."""
    from localmoe.testing import write_checkpoint

    hf = work / f"{family}-{size}"
    if not (hf / "config.json").exists():
        write_checkpoint(family, hf, size, seed=0, progress=False)
    gguf = work / f"{family}-{size}-{dtype}.gguf"
    if not gguf.exists():
        code = CONVERT.format(gguf_py=str(src / "gguf-py"), src=str(src), script=str(src / "convert_hf_to_gguf.py"))
        tmp = gguf.with_suffix(".tmp")
        done = subprocess.run([sys.executable, "-c", code, str(hf), "--outtype", dtype, "--outfile", str(tmp),
                               *CONVERT_ARGS.get(family, [])],
                              capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"llama.cpp's converter failed on {hf.name}:\n{done.stderr[-3000:]}")
        tmp.rename(gguf)
    return hf, gguf


def decode_bytes(model) -> int:
    """Weight bytes one decode token reads: every dense matrix and the head (not the embedding table), and
    top_k experts per MoE layer."""
    blocks = model.moe_blocks()
    providers = {id(b.experts): b.experts for b in blocks}
    experts = sum(p.nbytes() for p in providers.values())
    total = model.weight_bytes() - (0 if model.head_shares_embedding() else model.embed.nbytes) - experts
    per_expert = experts / max(1, sum(b.router.linear.weight.shape[0] for b in blocks))
    return int(total + per_expert * sum(b.router.rule.top_k for b in blocks))


def gguf_decode_bytes(path: Path) -> int:
    """Weight bytes one llama.cpp decode token reads from the GGUF: every tensor but the token embedding, the
    stacked experts (`*_exps`) at expert_used_count of expert_count."""
    import gguf as gguf_py

    reader = gguf_py.GGUFReader(path)

    def field(key: str) -> int:
        f = reader.fields[key]
        return int(f.parts[f.data[0]][0])

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    share = field(f"{arch}.expert_used_count") / field(f"{arch}.expert_count")
    return int(sum(t.n_bytes * (share if "_exps" in t.name else 1) for t in reader.tensors if t.name != "token_embd.weight"))


def roofline(bytes_: int, ours: float, theirs: float, bandwidth: float, theirs_bytes: int | None = None) -> str:
    """Decode rates (tokens/s) as fractions of the read roofline: each engine's bytes per token at `bandwidth`
    bytes/s (`theirs_bytes`: llama.cpp's where they differ from localmoe's `bytes_`, e.g. where localmoe keeps
    exactly-bf16 f32 weights as bf16)."""
    theirs_bytes = theirs_bytes or bytes_
    peer = "" if theirs_bytes == bytes_ else f" (llama.cpp {theirs_bytes / 1e6:.1f} MB)"
    return (f"{bytes_ / 1e6:.1f} MB of weights per decode token{peer}, read bandwidth {bandwidth / 1e9:.1f} GB/s "
            f"(roofline {bandwidth / bytes_:.0f} tok/s): localmoe at {bytes_ * ours / bandwidth:.2f} of it, llama.cpp "
            f"at {theirs_bytes * theirs / bandwidth:.2f} of its own")


def timed(run, prompt, args) -> tuple[float, float, object]:
    """`args.prefills` timed prefills of `prompt` (each from an empty cache), the last one followed by the timed
    decode: (median prefill seconds, decode seconds, the last prefill's logits). Several prefills per process: one
    ~0.1 s prefill alone is the noisiest figure on a loaded machine."""
    prefills = [run(prompt, 0)[0] for _ in range(getattr(args, "prefills", 1) - 1)]
    prefill_s, decode_s, first = run(prompt, args.decode)
    return statistics.median([*prefills, prefill_s]), decode_s, first


def localmoe_worker(args) -> None:
    import torch

    from localmoe.config import EngineConfig
    from localmoe.engine.generate import prefill
    from localmoe.load import load_model

    torch.set_num_threads(args.threads)
    dtype = {"f32": "float32", "bf16": "bfloat16"}.get(args.dtype, args.dtype)  # "auto": GGUF blocks kept
    context = args.prompt + args.decode + 16
    config = EngineConfig(dtype=dtype, threads=args.threads, max_context=context, expert_precision=args.expert_precision)
    model = load_model(args.path, config, progress=False).model
    prompt = prompt_ids(args.prompt)

    clock = time.process_time if args.cpu_time else time.perf_counter

    def run(prompt, decode):
        cache = model.new_cache(1, context)
        start = clock()
        logits = prefill(model, prompt, cache)
        prefill_s, first = clock() - start, logits
        start = clock()
        for _ in range(decode):
            logits = model.forward(logits.argmax(-1).view(1, 1), cache)[:, -1]
        return prefill_s, clock() - start, first

    run(prompt, 4)  # warm up: kernel library, decode plan, a GGUF's prefill copies of its dense matrices
    prefill_s, decode_s, first = timed(run, prompt, args)
    if args.logits:
        np.save(args.logits, first[0].float().numpy())
    if args.positions:  # untimed: every prompt position's logits (one forward, as prefill's one chunk) and margins
        margins = record_router_margins(model)
        logits = model.forward(torch.tensor([prompt]), model.new_cache(1, context), all_logits=True)[0]
        np.savez(args.positions, logits=logits.float().numpy(), margin=torch.stack(margins).amin(0).numpy())
    emit({"prefill": args.prompt / prefill_s, "decode": args.decode / decode_s, "bytes": decode_bytes(model),
          "fused": type(model._plan.decoder).__name__ if model._plan is not None else ""})


def record_router_margins(model) -> list:
    """Wraps every MoE block's router (as the pager's hooks do) to append, per call, each row's margin: its
    k-th largest selection score (softmax / sigmoid, plus the correction bias) minus its (k+1)-th; returns
    the list the margins go to, one [rows] tensor per MoE layer and call. Group-limited routing (n_group > 1,
    not K3's) is measured on the ungrouped scores."""
    import torch

    margins: list = []

    class Recorder:
        def __init__(self, router):
            self.router = router

        def __call__(self, x):
            r = self.router
            z = torch.nn.functional.linear(x.float(), r.linear.weight.float(),
                                           None if r.linear.bias is None else r.linear.bias.float())
            scores = z.softmax(-1) if r.rule.scoring == "softmax" else z.sigmoid()
            choice = scores if r.correction_bias is None else scores + r.correction_bias
            top = choice.topk(r.rule.top_k + 1, dim=-1).values
            margins.append(top[:, -2] - top[:, -1])
            return r(x)

        def __getattr__(self, name):
            return getattr(self.router, name)

    for block in model.moe_blocks():
        block.router = Recorder(block.router)
    return margins


def agreement(ours: np.ndarray, theirs: np.ndarray, margin: np.ndarray, tie: float) -> str:
    """The logits agreement, per position [T, V], judged before the first router near-tie (module doc)."""
    diff = np.abs(ours - theirs).max(-1) / (theirs.max(-1) - theirs.min(-1))
    ties = np.flatnonzero(margin < tie)
    clean = int(ties[0]) if len(ties) else len(diff)
    apart = np.flatnonzero(diff > 1e-3)
    first = (f"first position over 1e-3: {int(apart[0])} (its router margin {margin[apart[0]]:.1e})"
             if len(apart) else "no position over 1e-3")
    before = f"before the first router margin under {tie:g}" if len(ties) else f"no router margin under {tie:g}"
    covered = (f"max over positions 0-{clean - 1} ({before}): {diff[:clean].max():.2e} of the range" if clean else
               f"no position before the first router margin under {tie:g} (position 0: {margin[0]:.1e}): not shown")
    return (f"{covered}; {first}; last position {diff[-1]:.2e}, same argmax there: "
            f"{int(ours[-1].argmax()) == int(theirs[-1].argmax())}; smallest margin {margin.min():.1e}")


def llama_worker(args) -> None:
    import llama_cpp
    from llama_cpp import Llama

    context = args.prompt + args.decode + 16
    llm = Llama(args.path, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=context, n_batch=512,
                type_k=0, type_v=0, verbose=False)  # GGML_TYPE_F32 K/V cache
    prompt = prompt_ids(args.prompt)

    def last_logits():  # Llama.scores holds logits only with logits_all: read the context's own
        return np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))

    clock = time.process_time if args.cpu_time else time.perf_counter

    def run(prompt, decode):
        llm.reset()  # n_tokens 0 (eval drops the KV rows from there) and, recurrent / hybrid models, memory cleared
        start = clock()
        llm.eval(prompt)
        prefill_s = clock() - start
        first = last_logits().copy()
        start = clock()
        for _ in range(decode):
            llm.eval([int(np.argmax(last_logits()))])
        return prefill_s, clock() - start, first

    run(prompt, 4)
    prefill_s, decode_s, first = timed(run, prompt, args)
    if args.logits:
        np.save(args.logits, first)
    if args.positions:  # untimed: every prompt position's logits, from one batch as the timed prefill
        llm.reset()
        llm._logits_all = True  # eval() then asks the context for every row's logits
        llm.eval(prompt)
        rows = [np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, i), shape=(llm.n_vocab(),)).copy()
                for i in range(len(prompt))]
        np.savez(args.positions, logits=np.stack(rows))
    emit({"prefill": args.prompt / prefill_s, "decode": args.decode / decode_s})


def compare(family: str, size: str, args, work: Path, src: Path) -> None:
    import torch
    from common import memory_read_bandwidth

    hf, gguf = prepare(family, size, args.dtype, work, src)
    common = ["--threads", str(args.threads), "--prompt", str(args.prompt), "--dtype", args.dtype,
              "--prefills", str(args.prefills), *(["--cpu-time"] * args.cpu_time)]
    me = Path(__file__).resolve()
    workers = {"localmoe": [str(me), "--worker", "localmoe", "--path", str(hf), "--decode", str(args.decode),
                            "--expert-precision", args.expert_precision, *common],
               "llama.cpp": [str(me), "--worker", "llama", "--path", str(gguf), "--decode", str(args.decode), *common]}
    torch.set_num_threads(args.threads)
    bandwidth: list[float] = []

    def show(r: int, res: dict) -> None:
        ours, theirs = res["localmoe"], res["llama.cpp"]
        print(f"  round {r + 1}: decode {ours['decode']:6.1f} vs {theirs['decode']:6.1f} tok/s "
              f"({ours['decode'] / theirs['decode']:.2f}x), prefill {ours['prefill']:6.1f} vs "
              f"{theirs['prefill']:6.1f} tok/s ({ours['prefill'] / theirs['prefill']:.2f}x), "
              f"read bandwidth {bandwidth[-1] / 1e9:.1f} GB/s", flush=True)

    print(f"{family} {size}, {args.dtype} dense weights, routed experts as stored (MXFP4 ones at "
          f"{args.expert_precision} in localmoe), "
          f"{args.threads} threads, "
          f"{args.prompt}-token prompt, {args.decode} greedy tokens, {args.pairs} alternating rounds", flush=True)
    clock = time.process_time if args.cpu_time else time.perf_counter  # the engines' own clock
    res = alternate(workers, args.pairs, between=lambda: bandwidth.append(memory_read_bandwidth(clock=clock)), show=show)
    ours, theirs = res["localmoe"], res["llama.cpp"]
    med = {k: {m: statistics.median(r[m] for r in v) for m in ("decode", "prefill")} for k, v in res.items()}
    bytes_ = ours[0]["bytes"]
    bw = statistics.median(bandwidth)
    print(f"  medians: decode {med['localmoe']['decode']:.1f} vs {med['llama.cpp']['decode']:.1f} tok/s, "
          f"localmoe / llama.cpp {median_ratio([r['decode'] for r in ours], [r['decode'] for r in theirs]):.2f}x; "
          f"prefill {med['localmoe']['prefill']:.1f} vs {med['llama.cpp']['prefill']:.1f} tok/s, "
          f"{median_ratio([r['prefill'] for r in ours], [r['prefill'] for r in theirs]):.2f}x; localmoe prefill / "
          f"decode {med['localmoe']['prefill'] / med['localmoe']['decode']:.2f}")
    print(f"  {roofline(bytes_, med['localmoe']['decode'], med['llama.cpp']['decode'], bw, gguf_decode_bytes(gguf))}; "
          f"localmoe decode path: "
          f"{ours[0]['fused'] or 'op by op'}")
    twin = dequantized_twin(gguf, args)
    for label, paths, precision in (("MXFP4 weights, q8 expert activations (for information)", (hf, gguf), "q8"),
                                    ("experts dequantised to F32, fp32 activations", (twin, twin), "exact")):
        if None in paths:
            print(f"  logits, {label}: the twin would exceed --twin-limit {args.twin_limit:g} GB: not run")
            continue
        a, b = (positions(name, path, precision, common, work / f"{family}-{size}-{name}.npz")
                for name, path in zip(("localmoe", "llama"), paths))
        print(f"  logits, {label}, max |localmoe - llama.cpp| over the range: "
              f"{agreement(a['logits'], b['logits'], a['margin'], args.tie_margin)}", flush=True)


def dequantized_twin(gguf: Path, args) -> Path | None:
    """The GGUF again with its MXFP4 tensors as F32 (module doc), made once beside it; None if larger than
    --twin-limit GB."""
    import gguf as gguf_py

    from localmoe.testing.gguf_split import rewrite_gguf

    twin = gguf.with_name(gguf.stem + "-dequantized.gguf")
    if twin.exists():
        return twin
    size = sum(t.n_elements * 4 if t.tensor_type.name == "MXFP4" else t.n_bytes
               for t in gguf_py.GGUFReader(gguf).tensors)
    if size > args.twin_limit * 1e9:
        return None
    tmp = twin.with_suffix(".tmp")
    rewrite_gguf(gguf, tmp, dequantize=("MXFP4",))
    return tmp.rename(twin)


def positions(worker: str, path: Path, precision: str, common: list[str], out: Path) -> dict:
    """One untimed worker run (`--decode 1`) that saves every prompt position's logits (and localmoe's router
    margins) of the model at `path`."""
    from alternate import run_worker

    me = str(Path(__file__).resolve())
    run_worker([me, "--worker", worker, "--path", str(path), "--decode", "1", "--positions", str(out),
                "--expert-precision", precision, *common, "--prefills", "1"])
    return np.load(out)


def peer_benchmark(parser: argparse.ArgumentParser, compare, localmoe_worker) -> None:
    """What every benchmark against llama.cpp on generated models shares: the common arguments, the workers
    (`--worker`, run by `alternate`), the llama-cpp-python check, the work folder and the models' loop, calling
    `compare(family, size, args, work, llama_src)` per `--models` entry."""
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=72)
    parser.add_argument("--decode", type=int, default=64)
    parser.add_argument("--work", help="folder for checkpoints, GGUFs and the sdist (kept; default: a temporary one)")
    parser.add_argument("--llama-src", help="an unpacked llama.cpp source folder with convert_hf_to_gguf.py")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time each engine by its process's CPU time, not the wall clock (steadier on a loaded "
                             "machine; with --threads 1 both engines compute on one thread)")
    parser.add_argument("--twin-limit", type=float, default=4.0,
                        help="largest dequantised twin (GB) to write for the logits check (module doc)")
    parser.add_argument("--tie-margin", type=float, default=1e-4,
                        help="router margins under this (selection-score units) count as near-ties (module doc)")
    parser.add_argument("--worker", choices=("localmoe", "llama"), help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--logits", help=argparse.SUPPRESS)  # the last prompt position's logits (.npy)
    parser.add_argument("--positions", help=argparse.SUPPRESS)  # every position's, localmoe's router margins (.npz)
    args = parser.parse_args()
    if args.worker:
        (localmoe_worker if args.worker == "localmoe" else llama_worker)(args)
        return
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        raise SystemExit("needs llama-cpp-python (pip install llama-cpp-python==0.3.36) and gguf") from None
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        src = llama_src(work, args.llama_src)
        for item in args.models.split(","):
            family, _, size = item.partition(":")
            compare(family, size or "small", args, work, src)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="kimi_k3:small", help="family:size, comma-separated")
    parser.add_argument("--dtype", choices=("f32", "bf16"), default="f32")
    parser.add_argument("--expert-precision", choices=("q8", "exact"), default="q8",
                        help="localmoe's MXFP4 expert activations (q8: int8 per 32 values, as llama.cpp's)")
    parser.add_argument("--prefills", type=int, default=5,
                        help="timed prefills per engine process (each from an empty cache / a cleared llama.cpp "
                             "context), their median taken: the round's prefill figure")
    peer_benchmark(parser, compare, localmoe_worker)


if __name__ == "__main__":
    main()
