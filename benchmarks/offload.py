"""Offload benchmark: decode a model whose experts do not fit the RAM budget.

    python benchmarks/offload.py [--work DIR] [--tokens N] [--threads T]

On the `large` generated gpt_oss checkpoint (10.3 GB of MXFP4 experts) with a RAM budget of
25% of the expert bytes, prints in one run:
- localmoe decode tokens/s over llama.cpp's (llama-cpp-python, the same weights written as a
  GGUF with MXFP4 experts, mmap on, same threads, same cgroup memory limit);
- each policy's hit rate over Belady's at the same number of slots and at 10/25/50% of the
  experts, on the routing trace the run recorded (random weights: near-uniform routing) and
  on a SYNTHETIC trace with the published locality (~30% next-token reuse, Zipf popularity),
  labelled, where LFRU also runs with a calibration profile from another synthetic run;
- the fraction of disk-read time that overlapped compute.
Each engine runs in its own process inside a cgroup v1 memory group with the same limit:
localmoe's footprint before decoding (dense weights + the RAM slab = the budget) + slack.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = [17, 230]  # short: prefill cost is not what this measures
SLACK = 192 << 20  # allocator + interpreter headroom on top of localmoe's measured footprint

# ---- the two engines, each in its own process ----

def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def child_localmoe(args) -> dict:
    import torch

    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.load import load_model
    from localmoe.paging.budget import MemoryCgroup
    from localmoe.paging.metrics import pager_of
    from localmoe.paging.trace import RoutingTrace

    group = MemoryCgroup(args.cgroup) if args.cgroup else None
    if group:
        group.add()
    paging = PagingConfig(ram_budget=args.budget, policy=args.policy, io=args.io, prefetch=not args.no_prefetch)
    config = EngineConfig(dtype=args.dtype, threads=args.threads, paging=paging)
    model = load_model(args.store, config, progress=False).model
    pager = pager_of(model)
    trace = RoutingTrace(num_experts=model.spec.num_experts)
    for block in model.moe_blocks():
        block.router.trace = trace
    _drop_cache([pager.store.expert_extent(layer, 0).path for layer in pager.store.layers()])
    footprint = group.usage() if group else 0
    limit = (args.limit or footprint + SLACK) if group else 0
    if group:  # both engines get localmoe's footprint (dense weights + the slab = the budget) + slack
        group.set_limit(limit)
        group.reset_peak()
    cache = model.new_cache(1, len(PROMPT) + args.tokens + 1)
    logits = model.forward(torch.tensor([PROMPT]), cache)
    token = int(logits[0, -1].argmax())
    tokens, started = [token], time.perf_counter()
    for _ in range(args.tokens - 1):
        token = int(model.forward(torch.tensor([[token]]), cache)[0, -1].argmax())
        tokens.append(token)
    seconds = time.perf_counter() - started
    trace.save(args.trace_out)
    out = {"tokens": tokens, "decode_tok_s": (args.tokens - 1) / seconds, "footprint": footprint, "limit": limit,
           "stats": pager.stats.to_dict(), "summary": pager.stats.summary()}
    if group:
        out |= {"max_usage": group.max_usage(), "failcnt": group.failcnt()}
    pager.close()
    return out


def child_llama(args) -> dict:
    from localmoe.paging.budget import MemoryCgroup

    group = MemoryCgroup(args.cgroup) if args.cgroup else None
    if group:
        group.add()
        if args.limit:
            group.set_limit(args.limit)
        group.reset_peak()
    import llama_cpp.llama_cpp as C

    default_params = C.llama_model_default_params

    def no_repack():
        # llama.cpp's CPU backend otherwise copies ("repacks") every MXFP4 expert into anonymous
        # memory at load (10 GB here), which defeats mmap and cannot run under the memory limit
        params = default_params()
        params.use_extra_bufts = False
        return params

    C.llama_model_default_params = no_repack
    from llama_cpp import Llama

    _drop_cache([args.gguf])
    llm = Llama(model_path=str(args.gguf), n_ctx=256, n_threads=args.threads, n_threads_batch=args.threads,
                use_mmap=True, use_mlock=False, n_gpu_layers=0, verbose=False)
    vocab = llm.n_vocab()

    def last_argmax() -> int:
        return int(np.argmax(np.ctypeslib.as_array(C.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(vocab,))))

    llm.eval(PROMPT)
    token = last_argmax()
    tokens, started = [token], time.perf_counter()
    for _ in range(args.tokens - 1):
        llm.eval([token])
        token = last_argmax()
        tokens.append(token)
    seconds = time.perf_counter() - started
    out = {"tokens": tokens, "decode_tok_s": (args.tokens - 1) / seconds}
    if group:
        out |= {"max_usage": group.max_usage(), "failcnt": group.failcnt()}
    return out


def _run_child(kind: str, args, extra: list[str], timeout: float) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, "--threads", str(args.threads), "--tokens", str(args.tokens),
           *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("LOCALMOE_CACHE", Path.home() / ".cache" / "localmoe"))
    ap.add_argument("--work", type=Path, default=cache / "bench",
                    help="where the checkpoint, its store and its GGUF are kept (~33 GB)")
    ap.add_argument("--tokens", type=int, default=12)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--fraction", type=float, default=0.25, help="RAM budget as a fraction of the expert bytes")
    ap.add_argument("--child", choices=["localmoe", "llama"])
    ap.add_argument("--store", type=Path)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--budget", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--cgroup", default="")
    ap.add_argument("--policy", default="lfru")
    ap.add_argument("--io", default="odirect")
    ap.add_argument("--no-prefetch", action="store_true")
    ap.add_argument("--trace-out", type=Path)
    ap.add_argument("--dtype", default="float32", help="localmoe's dense weights (auto: a GGUF's blocks as stored)")
    args = ap.parse_args()
    if args.child:
        print(json.dumps((child_localmoe if args.child == "localmoe" else child_llama)(args)))
        return
    run(args)


def run(args) -> None:
    from localmoe.checkpoint import store_spec
    from localmoe.convert import convert
    from localmoe.paging import expert_bytes
    from localmoe.paging.budget import MemoryCgroup, cgroup_writable
    from localmoe.paging.trace import RoutingTrace
    from localmoe.store.packed import PackedStore
    from localmoe.testing import write_checkpoint
    from localmoe.testing.gpt_oss_gguf import write_gguf

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    src, store_path, gguf_path = work / "gpt_oss_large", work / "gpt_oss_large.lmoe", work / "gpt_oss_large.gguf"
    if not (src / "config.json").exists():
        print("writing the large gpt_oss checkpoint ...", flush=True)
        write_checkpoint("gpt_oss", src, size="large")
    if not (store_path / "manifest.json").exists():
        print("converting it to a packed store ...", flush=True)
        convert(src, store_path)
    if not gguf_path.exists():
        print("writing it as GGUF (MXFP4 experts) ...", flush=True)
        write_gguf(src, gguf_path)
    store = PackedStore(store_path)
    total = expert_bytes(store)
    slot = max(store.layout(layer).slot_bytes for layer in store.layers())
    budget = int(total * args.fraction) // slot * slot
    slots = budget // slot
    print(f"model: {src.name}, {total / 1e9:.2f} GB of experts ({total // slot} x {slot / 2**20:.2f} MiB); RAM "
          f"budget {budget / 1e9:.2f} GB = {slots} slots ({args.fraction:.0%}); {args.threads} threads, "
          f"{args.tokens} decode tokens", flush=True)
    cg = f"localmoe-offload-{os.getpid()}" if cgroup_writable() else ""
    common = ["--store", str(store_path), "--budget", str(budget), "--trace-out", str(work / "offload-trace.json")]
    try:
        ours = _run_child("localmoe", args, common + (["--cgroup", cg] if cg else []), 5400)
    finally:
        if cg:
            MemoryCgroup(cg).remove()
    if "error" in ours:
        raise SystemExit(f"localmoe failed: {ours['error']}")
    limit = ours["limit"]
    if cg:
        print(f"memory limit for both engines (cgroup v1): {limit / 1e9:.2f} GB = localmoe's footprint "
              f"{ours['footprint'] / 1e9:.2f} GB (dense weights + RAM slab) + {SLACK >> 20} MiB", flush=True)
    peer = {"error": "llama-cpp-python is not installed"}
    try:
        import llama_cpp  # noqa: F401

        peer = _run_child("llama", args, ["--gguf", str(gguf_path), "--limit", str(limit)]
                          + (["--cgroup", cg + "-llama"] if cg else []), 5400)
    except ImportError:
        pass
    finally:
        if cg:
            MemoryCgroup(cg + "-llama").remove()
    ram = ours["stats"]["tiers"]["ram"]
    pf = ours["stats"]["prefetch"]
    print(f"\nlocalmoe ({ours['stats']['policy']}, {ours['stats']['backend']}, prefetch): "
          f"{ours['decode_tok_s']:.3f} tok/s; {ours['summary']}")
    if cg:
        print(f"  cgroup: peak {ours['max_usage'] / 1e9:.2f} GB of {limit / 1e9:.2f} GB, limit hit "
              f"{ours['failcnt']} times")
    if "error" in peer:
        print(f"llama.cpp: not measured: {peer['error'].strip().splitlines()[-1] if peer['error'] else ''}")
    else:
        print(f"llama.cpp (mmap, {args.threads} threads): {peer['decode_tok_s']:.3f} tok/s"
              + (f"; cgroup peak {peer['max_usage'] / 1e9:.2f} GB, limit hit {peer['failcnt']} times" if cg else ""))
        same = sum(a == b for a, b in zip(ours["tokens"], peer["tokens"]))
        print(f"  greedy tokens equal to localmoe's: {same}/{len(ours['tokens'])}")
        print(f"RATIO decode tok/s localmoe / llama.cpp: {ours['decode_tok_s'] / peer['decode_tok_s']:.2f}x "
              f"(goal >= 2x)")
    print(f"RATIO disk-read time overlapped with compute: {ram['overlap']:.1%} "
          f"(read {ram['read_seconds']:.1f} s, stalled {ram['stall_seconds']:.1f} s); prefetch precision "
          f"{pf['precision']:.1%}, recall {pf['recall']:.1%}")
    recorded = RoutingTrace.load(work / "offload-trace.json")
    spec = store_spec(store)
    print_policy_ratios(recorded, spec.num_experts, spec.num_experts_per_tok, slots)


def print_policy_ratios(recorded, num_experts: int, top_k: int, slots: int) -> None:
    """Each policy's hit rate over Belady's at the run's slots and at 10/25/50% of the experts, on the
    recorded trace and on a SYNTHETIC locality trace for the same shape; on the latter also LFRU with a
    calibration profile taken from another synthetic run of the same model (`--profile`)."""
    from localmoe.paging.policy import popularity
    from localmoe.paging.simulate import replay
    from localmoe.paging.trace import synthetic_trace

    layers = recorded.layers
    total = len(layers) * num_experts
    sizes = sorted({slots, *(int(total * f) for f in (0.10, 0.25, 0.50))})
    synthetic = synthetic_trace(layers, num_experts, top_k, 400, seed=0)
    cal = synthetic_trace(layers, num_experts, top_k, 400, seed=0, draws=1)
    profile = {"popularity": popularity([(layer, e, int(c)) for layer, cs in cal.popularity().items()
                                         for e, c in enumerate(cs)], cal.tokens), "popularity_tokens": cal.tokens}
    traces = [(f"recorded (random weights, near-uniform routing, reuse {recorded.reuse():.1%}; prefill + decode)",
               recorded, {}),
              ("SYNTHETIC (~30% next-token reuse, Zipf s=1.0, 400 tokens)", synthetic, {"lfru+profile": profile})]
    for label, trace, extra in traces:
        acc = trace.accesses()
        print(f"trace: {label}")
        print("  slots          " + "".join(f"{p:>14}" for p in ("lru", "lfu", "lfru", *extra, "belady")))
        for n in sizes:
            best = replay(acc, "belady", n).hit_rate
            runs = {p: replay(acc, p, n).hit_rate for p in ("lru", "lfu", "lfru")}
            runs |= {p: replay(acc, "lfru", n, **options).hit_rate for p, options in extra.items()}
            cells = "".join(f"  {r:5.1%} ({r / best if best else 0.0:.2f})" for r in runs.values())
            print(f"  {n:5} ({n / total:4.0%})" + cells + f"  {best:12.1%}")
    print("RATIO LFRU / Belady in parentheses (goal LFRU >= 0.9 on the locality trace)")

if __name__ == "__main__":
    main()
