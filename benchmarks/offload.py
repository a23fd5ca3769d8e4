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

# ---- the same model as GGUF (llama.cpp's gpt-oss layout, MXFP4 experts) ----

_LAYER_NAMES = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
                "post_attention_norm.weight", "self_attn.sinks": "attn_sinks.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.router.bias": "ffn_gate_inp.bias",
                **{f"self_attn.{p}_proj.{k}": f"attn_{'output' if p == 'o' else p}.{k}"
                   for p in "qkvo" for k in ("weight", "bias")}}


def _ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP/HF MXFP4 (byte j = elements 2j (low nibble), 2j+1) [..., nb, 16] + scales [..., nb] ->
    ggml block_mxfp4 bytes [..., nb * 17]: the E8M0 scale, then byte j = element j (low), j + 16 (high)."""
    vals = np.empty(blocks.shape[:-1] + (32,), dtype=np.uint8)
    vals[..., 0::2], vals[..., 1::2] = blocks & 0x0F, blocks >> 4
    out = np.empty(blocks.shape[:-1] + (17,), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = vals[..., :16] | (vals[..., 16:] << 4)
    return out.reshape(*blocks.shape[:-2], -1)


def _dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """OCP/HF MXFP4 blocks [..., nb, 16] + E8M0 scales [..., nb] -> float32 [..., nb * 32], exactly."""
    fp4 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
    vals = np.empty(blocks.shape[:-1] + (32,), dtype=np.float32)
    vals[..., 0::2], vals[..., 1::2] = fp4[blocks & 0x0F], fp4[blocks >> 4]
    vals *= np.ldexp(np.float32(1), scales.astype(np.int32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:-2], -1)


def _bf16_in_gguf(name: str) -> bool:
    """Whether a `dense="bf16"` GGUF stores tensor `name` as BF16: the 2-D matrices, as llama.cpp's
    convert_hf_to_gguf.py --outtype bf16 does (norms, biases, sinks and the router stay F32)."""
    return name in ("token_embd.weight", "output.weight") or (
        name.startswith("blk.") and name.split(".", 2)[2].startswith("attn_") and name.endswith(
            ("_q.weight", "_k.weight", "_v.weight", "_output.weight")))


def _gguf_tensors(ckpt, layers: int, experts: str = "mxfp4", dense: str = "f32"):
    """(gguf name, producer of the numpy array, raw ggml type or None) in file order."""
    import gguf

    def f32(name):
        return lambda: ckpt.tensor(name).float().numpy()

    def bf16(name):  # the checkpoint's bf16 bits, unchanged
        import torch

        return lambda: ckpt.tensor(name).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)

    def matrix(gguf_name, name):
        if dense == "bf16" and _bf16_in_gguf(gguf_name):
            return gguf_name, bf16(name), gguf.GGMLQuantizationType.BF16
        return gguf_name, f32(name), None

    out = [matrix("token_embd.weight", "model.embed_tokens.weight"),
           ("output_norm.weight", f32("model.norm.weight"), None), matrix("output.weight", "lm_head.weight")]
    mx = gguf.GGMLQuantizationType.MXFP4 if experts == "mxfp4" else None
    pack = _ggml_mxfp4 if experts == "mxfp4" else _dequantized
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [matrix(f"blk.{i}.{dst}", p + src) for src, dst in _LAYER_NAMES.items()]
        e = p + "mlp.experts."
        for half, name in ((0, "gate"), (1, "up")):
            out.append((f"blk.{i}.ffn_{name}_exps.weight", lambda e=e, h=half: pack(
                ckpt.tensor(e + "gate_up_proj_blocks")[:, h::2].numpy(),
                ckpt.tensor(e + "gate_up_proj_scales")[:, h::2].numpy()), mx))
            out.append((f"blk.{i}.ffn_{name}_exps.bias",
                        lambda e=e, h=half: ckpt.tensor(e + "gate_up_proj_bias")[:, h::2].float().numpy(), None))
        out.append((f"blk.{i}.ffn_down_exps.weight", lambda e=e: pack(
            ckpt.tensor(e + "down_proj_blocks").numpy(), ckpt.tensor(e + "down_proj_scales").numpy()), mx))
        out.append((f"blk.{i}.ffn_down_exps.bias", lambda e=e: ckpt.tensor(e + "down_proj_bias").float().numpy(),
                    None))
    return out


def write_gguf(src: Path, dst: Path, experts: str = "mxfp4", dense: str = "f32") -> Path:
    """Write the gpt_oss HF checkpoint `src` as a llama.cpp GGUF (dense F32, experts MXFP4), streaming.

    dense="bf16" keeps the checkpoint's bf16 matrices as BF16 (the attention projections, embedding
    and lm_head; see _bf16_in_gguf), the lossless conversion of a bf16 source.
    experts="f32" writes the experts dequantised (exact, 7.5x the bytes): llama.cpp's CPU MXFP4
    matmul rounds activations to Q8_0, which on random weights flips top-k routing and moves the
    logits visibly; F32 experts take that rounding out, for parity checks (gguf_parity.py)."""
    assert experts in ("mxfp4", "f32") and dense in ("f32", "bf16"), (experts, dense)
    import gguf

    from localmoe.store.safetensors import SafetensorsCheckpoint

    cfg = json.loads((src / "config.json").read_text())
    tok = json.loads((src / "tokenizer.json").read_text())
    gen = json.loads((src / "generation_config.json").read_text())
    ckpt = SafetensorsCheckpoint(src)
    tmp = dst.with_name(dst.name + ".partial")
    w = gguf.GGUFWriter(tmp, "gpt-oss")
    w.add_name(f"localmoe test {src.name}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(float(cfg["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["num_local_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_feed_forward_length(cfg["intermediate_size"])
    w.add_sliding_window(cfg["sliding_window"])
    rs = cfg["rope_scaling"]
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(rs["factor"])
    w.add_rope_scaling_orig_ctx_len(rs["original_max_position_embeddings"])
    w.add_rope_scaling_yarn_beta_fast(float(rs.get("beta_fast") or 32))
    w.add_rope_scaling_yarn_beta_slow(float(rs.get("beta_slow") or 1))
    # tokenizer: byte-level BPE, padded to vocab_size with unused tokens
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    special = {t["id"] for t in tok["added_tokens"]}
    names = [f"[PAD{i}]" for i in range(cfg["vocab_size"])]
    types = [gguf.TokenType.UNUSED] * cfg["vocab_size"]
    for text, i in vocab.items():
        names[i] = text
        types[i] = gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(names)
    w.add_token_types(types)
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    w.add_bos_token_id(gen["bos_token_id"])
    eos = gen["eos_token_id"]
    w.add_eos_token_id(eos[0] if isinstance(eos, list) else eos)
    tensors = _gguf_tensors(ckpt, cfg["num_hidden_layers"], experts, dense)
    shapes = {}
    for name, make, raw in tensors:  # shapes without materialising experts: derive from the checkpoint
        shapes[name] = _shape_of(ckpt, name, cfg, experts)
        if raw == gguf.GGMLQuantizationType.BF16:
            shapes[name] = shapes[name][0], np.uint16
        nbytes = int(np.prod(shapes[name][0])) * np.dtype(shapes[name][1]).itemsize
        w.add_tensor_info(name, shapes[name][0], np.dtype(shapes[name][1]), nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, make, raw in tensors:
        arr = np.ascontiguousarray(make())
        assert tuple(arr.shape) == tuple(shapes[name][0]), (name, arr.shape, shapes[name][0])
        w.write_tensor_data(arr)
    w.close()
    os.replace(tmp, dst)
    return dst


def _shape_of(ckpt, name: str, cfg: dict, experts: str = "mxfp4"):
    """(numpy shape, dtype) a GGUF tensor's producer returns (bytes for MXFP4)."""
    E, D, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    if name.endswith("_exps.weight"):
        rows, cols = (D, I) if "down" in name else (I, D)
        return ((E, rows, cols // 32 * 17), np.uint8) if experts == "mxfp4" else ((E, rows, cols), np.float32)
    if name.endswith("_exps.bias"):
        return (E, D if "down" in name else I), np.float32
    hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
          "output.weight": "lm_head.weight"}.get(name)
    if hf is None:
        i, rest = name.split(".", 2)[1:]
        hf = f"model.layers.{i}." + next(k for k, v in _LAYER_NAMES.items() if v == rest)
    return tuple(ckpt.info(hf).shape), np.float32


# ---- the two engines, each in its own process ----

def _drop_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def child_localmoe(args) -> dict:
    import torch

    from localmoe.config import EngineConfig
    from localmoe.paging import PagingConfig
    from localmoe.paging.budget import MemoryCgroup
    from localmoe.paging.standalone import build_paged
    from localmoe.paging.trace import RoutingTrace

    group = MemoryCgroup(args.cgroup) if args.cgroup else None
    if group:
        group.add()
    torch.set_num_threads(args.threads)
    paging = PagingConfig(ram_budget=args.budget, policy=args.policy, io=args.io, prefetch=not args.no_prefetch)
    model, pager = build_paged(args.store, paging, EngineConfig(dtype="float32", threads=args.threads))
    trace = RoutingTrace(num_experts=model.spec.num_experts)
    for block in model.moe_blocks():
        block.router.trace = trace
    _drop_cache([pager.store.expert_extent(layer, 0).path for layer in pager.store.layers()])
    footprint = group.usage() if group else 0
    limit = footprint + SLACK if group else 0
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
    args = ap.parse_args()
    if args.child:
        print(json.dumps((child_localmoe if args.child == "localmoe" else child_llama)(args)))
        return
    run(args)


def run(args) -> None:
    from localmoe.paging import expert_bytes
    from localmoe.paging.budget import MemoryCgroup, cgroup_writable
    from localmoe.paging.trace import RoutingTrace
    from localmoe.store.convert import convert
    from localmoe.store.packed import PackedStore
    from localmoe.testing import write_checkpoint

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
    print_policy_ratios(recorded, store.spec.num_experts, store.spec.num_experts_per_tok, slots)


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
