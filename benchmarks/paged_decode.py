"""Paged decode against resident decode on the same weights, with the paged time accounted for.

A generated checkpoint (`localmoe.testing`, default Kimi K3 `small`) runs resident (the HF directory) and from
its packed store under each `--ram` budget (share of the expert bytes), each run in a process of its own, the
runs alternating (benchmarks/alternate.py, the order reversed every round), greedy, 1 thread by default. Per
decode token each worker reports CPU time (the process, and the compute thread alone: the pager's I/O threads
read and check extents on their own threads) and wall time; a paged worker also reports the pager's counters:
- stall: compute waited for reads; read: wall time with a read in flight (I/O threads);
- lookup: the pager's own work on the compute thread (`get`, `hold`, routing hints, eviction choice), stalls
  excluded;
- moe: wall time inside the routed experts of the paged layers (the fused step's callback: routing, pager calls,
  the experts' kernel), stalls included;
- missed MB: bytes of the experts a token needed that were not in RAM when routing chose them (demand misses,
  and requests a router-lookahead guess had started reading), per token; read MB: bytes read (with the guesses
  that were never used).
The accounting baseline is the resident run, or with `--no-resident` paged 100% (every expert read into the
slab's anonymous memory at load, no routing hooks: resident speed without the HF checkpoint's page-cache
mapping, which a busy host evicts). Between rounds the parent measures the store's parallel O_DIRECT read bandwidth (the pager's thread count,
whole expert extents in a random order, the page cache bypassed), so the disk roofline of a paged run,
missed bytes per token / that bandwidth, is measured in the same run as the decode it bounds. Printed:
paged / baseline time per token, how much of the extra wall time per token (over the same round's baseline)
stall + lookup explain (the accounting: goal >= 90%), and the fraction of the disk roofline reached (the
round's roofline time per token / wall time per token: goal >= 0.7 at 25%). Greedy tokens of
every run are checked equal to the resident run's.

With `--base DIR` (a snapshot of another commit: `git worktree add DIR REV`), every budget below 100% also runs
from DIR's localmoe (and its kernels), in the same rounds, alternating: the A/B of a pager change, printed as
this tree / the base per round (CPU, compute thread, wall, stall, lookup) and their medians.

    python benchmarks/paged_decode.py [--model kimi_k3:small] [--ram 100%,25%] [--pairs 3] [--threads 1]
                                      [--prompt 64] [--decode 32] [--work DIR] [--base DIR]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from alternate import alternate, emit


def prompt_ids(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 600) for _ in range(n)]


def prepare(family: str, size: str, work: Path, resident: bool = True) -> tuple[Path, Path]:
    """(HF checkpoint, its packed store), made once in `work` (the checkpoint may be deleted once converted if
    `resident` is off)."""
    from localmoe.convert import convert
    from localmoe.testing import write_checkpoint

    hf, store = work / f"{family}-{size}", work / f"{family}-{size}.lmoe"
    if not (hf / "config.json").exists() and (resident or not (store / "manifest.json").exists()):
        write_checkpoint(family, hf, size, seed=0, progress=False)
    if not (store / "manifest.json").exists():
        convert(hf, store)
    return hf, store


def odirect_bandwidth(store_path: Path, threads: int, seconds: float = 1.5) -> float:
    """Bytes/s of whole expert extents read with O_DIRECT by `threads` threads at once, random order."""
    import mmap

    from localmoe.store.packed import PackedStore

    store = PackedStore(store_path)
    extents = [store.expert_extent(layer, e) for layer in store.layers() for e in store.experts_in(layer)]
    random.Random(time.time_ns()).shuffle(extents)
    size = max(ext.nbytes for ext in extents)
    size += -size % mmap.PAGESIZE
    fds = {}

    def fd(path):
        if path not in fds:
            fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
        return fds[path]

    for ext in extents:
        fd(ext.path)
    deadline = time.perf_counter() + seconds
    lock_free = iter(extents * 64)

    def reader() -> int:
        buf = mmap.mmap(-1, size)
        done = 0
        for ext in lock_free:
            if time.perf_counter() > deadline:
                break
            done += os.preadv(fds[ext.path], [memoryview(buf)[:ext.nbytes + (-ext.nbytes % mmap.PAGESIZE)]],
                              ext.offset)
        buf.close()
        return done

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda _: reader(), range(threads)))
    elapsed = time.perf_counter() - start
    for f in fds.values():
        os.close(f)
    return total / elapsed


def thread_cpu(tids=None) -> dict[int, float]:
    """CPU seconds (user + system) of this process's threads so far, by thread id (/proc; {} where it is missing)."""
    out = {}
    try:
        names = os.listdir("/proc/self/task") if tids is None else [str(t) for t in tids]
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for name in names:
        try:
            with open(f"/proc/self/task/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(name)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return out


def timed_kernels(total: list[float]) -> None:
    """The routed experts' kernel calls of the fused step's callback (engine/decode_plan.py `_routed`) add their
    wall time to total[0]: the experts' own compute, apart from the callback's Python and the pager's calls."""
    from localmoe.engine import decode_plan
    from localmoe.kernels.decode_layers import hybrid

    def timing(fn):
        def call(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                total[0] += time.perf_counter() - start
        return call

    for name in ("mxfp4_moe", "ggml_moe_token"):
        setattr(decode_plan, name, timing(getattr(decode_plan, name)))
    for name in ("dense_experts_token", "dense_expert"):
        setattr(hybrid, name, timing(getattr(hybrid, name)))


def worker(args) -> None:
    if args.tree:  # a snapshot tree's localmoe (and kernels) before this one's
        import sys

        sys.path.insert(0, args.tree)
    import torch

    from localmoe.config import EngineConfig, PagingConfig
    from localmoe.engine.generate import prefill
    from localmoe.load import load_model
    from localmoe.paging import expert_bytes
    from localmoe.paging.metrics import pager_of
    from localmoe.store.packed import PackedStore

    torch.set_num_threads(args.threads)
    context = args.prompt + args.warmup + args.decode + 16
    paging = PagingConfig()
    if args.share:
        total = expert_bytes(PackedStore(args.path))
        paging = PagingConfig(ram_budget=int(total * args.share), io_threads=int(args.io_threads))
    config = EngineConfig(dtype=args.dtype, threads=args.threads, max_context=context,
                          expert_precision=args.expert_precision, paging=paging)
    if args.warm:  # the store's experts read once through the page cache, so its maps start warm (as resident)
        buf = bytearray(16 << 20)
        for layer_file in sorted((Path(args.path) / "experts").iterdir()):
            with open(layer_file, "rb", buffering=0) as f:
                while f.readinto(buf):
                    pass
    model = load_model(args.path, config, progress=False).model
    pager = pager_of(model)
    if pager is not None and args.guess_bar is not None:
        pager.guess_bar = float(args.guess_bar)
    if pager is not None and args.depth is not None and pager._resident is None:  # the lookahead's depth
        from localmoe.paging import attach

        attach(model, pager, depth=int(args.depth))
    if args.no_lookahead:  # the routing hints stay (each layer's misses read together), the guesses go
        for block in model.moe_blocks():
            if hasattr(block.router, "ahead"):
                block.router.ahead = []
    if int(args.rows) > 1:
        return rows_worker(args, model, pager, context)
    readers: set[int] = set()
    if pager is not None and pager._resident is None and pager.prefetch_enabled:  # a pager that reads: its readers
        before = set(thread_cpu())  # start with its first reads (one per read, up to io_threads): a few guesses
        first = min(pager.layouts)
        pager.prefetch(first, range(min(pager.io_threads, pager.experts_in(first))))
        readers = set(thread_cpu()) - before - {threading.get_native_id()}
    cache = model.new_cache(1, context)
    logits = prefill(model, prompt_ids(args.prompt), cache)
    tokens = []
    for _ in range(args.warmup):  # decode plan, kernel library, the pager's slab filled
        tokens.append(int(logits.argmax(-1)))
        logits = model.forward(torch.tensor([[tokens[-1]]]), cache)[:, -1]
    moe, kernels = [0.0], [0.0]  # the paged layers' callback, the experts' kernel calls in it
    decoder = model._plan.decoder if model._plan is not None else None
    if pager is not None and decoder is not None and decoder.experts is not None:
        inner = decoder.experts

        def timed(*a):
            start = time.perf_counter()
            try:
                return inner(*a)
            finally:
                moe[0] += time.perf_counter() - start

        decoder.experts = timed
        timed_kernels(kernels)
    if pager is not None:
        pager.stats.reset_counts()
    io = thread_cpu(readers)
    cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(args.decode):
        tokens.append(int(logits.argmax(-1)))
        logits = model.forward(torch.tensor([[tokens[-1]]]), cache)[:, -1]
    n = args.decode
    out = {"cpu": (time.process_time() - cpu) / n, "thread": (time.thread_time() - thread) / n,
           "wall": (time.perf_counter() - wall) / n, "tokens": tokens,
           "path": type(decoder).__name__ if decoder is not None else "op by op"}
    io_after = thread_cpu(readers)
    out["io_cpu"] = sum(io_after.get(t, 0.0) - c for t, c in io.items()) / n if io else None
    if pager is not None:
        ram, pf = pager.stats.ram, pager.stats.prefetch
        needed = ram.misses + pf.covered  # requests that found their expert on disk (or on its way from there)
        out |= {"stall": ram.stall_seconds / n, "read": ram.read_seconds / n, "lookup": ram.lookup_seconds / n,
                "hint": pf.hint_seconds / n, "kernels": kernels[0] / n,
                "moe": moe[0] / n, "missed": needed * pager.stats.slot_bytes / n, "misses": needed / n,
                "bytes_read": ram.bytes_read / n, "wasted": pf.wasted / n, "precision": pf.precision,
                "hit_rate": ram.hit_rate, "slots": pager.stats.slots, "issued": pf.issued / n, "late": pf.late / n,
                "readers": type(pager.readers).__name__}
        pager.close()
    emit(out)


def rows_worker(args, model, pager, context: int) -> None:
    """`--rows N`: N sequences (prompts of their own) decoded together, one batched step per token of each
    (engine/batch.py `decode_batch`, what the server's scheduler runs for N clients); per generated token (the
    step's figures / N) the same fields as the one-sequence worker, and the share of routed (token, expert) pairs
    the steps read (one request per distinct expert of a layer's step)."""
    import torch

    from localmoe.engine.batch import decode_batch
    from localmoe.engine.generate import prefill

    rows = int(args.rows)
    caches = [model.new_cache(1, context) for _ in range(rows)]
    logits = torch.cat([prefill(model, prompt_ids(args.prompt, seed), c) for seed, c in enumerate(caches)])
    tokens: list[list[int]] = [[] for _ in caches]

    def step() -> torch.Tensor:
        nxt = logits.argmax(-1).tolist()
        for row, t in zip(tokens, nxt):
            row.append(t)
        return decode_batch(model, nxt, caches)

    for _ in range(args.warmup):
        logits = step()
    if pager is not None:
        pager.stats.reset_counts()
    cpu, thread, wall = time.process_time(), time.thread_time(), time.perf_counter()
    for _ in range(args.decode):
        logits = step()
    n = args.decode * rows
    out = {"cpu": (time.process_time() - cpu) / n, "thread": (time.thread_time() - thread) / n,
           "wall": (time.perf_counter() - wall) / n, "tokens": tokens, "path": f"decode_batch x{rows}"}
    if pager is not None:
        stats = pager.stats
        ram, pf = stats.ram, stats.prefetch
        needed = ram.misses + pf.covered
        out |= {"stall": ram.stall_seconds / n, "read": ram.read_seconds / n, "lookup": ram.lookup_seconds / n,
                "moe": 0.0, "missed": needed * stats.slot_bytes / n, "misses": needed / n,
                "bytes_read": ram.bytes_read / n, "wasted": pf.wasted / n, "precision": pf.precision,
                "hit_rate": ram.hit_rate, "slots": stats.slots, "readers": type(pager.readers).__name__,
                "distinct": (ram.hits + ram.misses) / stats.routed if stats.routed else None}
        pager.close()
    emit(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="kimi_k3:small", help="family:size")
    parser.add_argument("--ram", default="100%,25%", help="paged budgets, shares of the expert bytes")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--io-threads", default="4", help="reader threads; several (e.g. 2,4): each budget below "
                        "100%% runs with each, alternating (the bandwidth is measured with the first)")
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--expert-precision", choices=("q8", "exact"), default="q8")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="dense weights")
    parser.add_argument("--no-resident", dest="resident", action="store_false",
                        help="paged runs only (the checkpoint may be deleted once converted: large models)")
    parser.add_argument("--store-resident", action="store_true", help="also run the store without a budget (its "
                        "experts mapped, the page cache read warm first; each layer whole in the kernels): the resident "
                        "side of paged 100%% where the HF checkpoint is gone")
    parser.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--work", help="folder for the checkpoint and its store (kept; default: a temporary one)")
    parser.add_argument("--base", help="a snapshot tree of another commit: each budget below 100%% also runs from "
                        "it, alternating (A/B)")
    parser.add_argument("--this", help="a snapshot tree the other runs load instead of this one (with --base: "
                        "both sides load a snapshot the same way; an A/B of this tree against a snapshot measured "
                        "the snapshot slower with identical code)")
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--no-lookahead", action="store_true", help="paged runs guess no later layer's experts")
    parser.add_argument("--guess-bar", default=None, help="the measured precision a guessed rank needs to be read "
                        "(Pager.guess_bar); several (e.g. 0.5,0.3): each budget below 100%% runs with each, "
                        "alternating")
    parser.add_argument("--depth", default=None, help="MoE layers the lookahead guesses ahead of each routed one "
                        "(paging.hooks DEPTH by default); several (e.g. 1,2): each budget below 100%% runs with each, "
                        "alternating")
    parser.add_argument("--rows", default="1", help="sequences decoded together in batched steps (each with a "
                        "prompt of its own; figures per generated token; the server's N-client step); several (e.g. "
                        "1,16): each budget below 100%% runs with each, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--share", type=float, default=0.0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(args.work or tmp))


def _first(tokens: list) -> list[int]:
    """A worker's greedy tokens, of its first sequence where it decoded several (row 0 has the one-sequence
    worker's prompt, and a batched row decodes as it would alone)."""
    return tokens[0] if tokens and isinstance(tokens[0], list) else tokens


def run(args, work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    family, _, size = args.model.partition(":")
    hf, store = prepare(family, size or "small", work, args.resident)
    me = str(Path(__file__).resolve())
    ios = [int(n) for n in str(args.io_threads).split(",")]
    args.io_threads = ios[0]
    counts = [int(n) for n in str(args.rows).split(",")]
    bars = str(args.guess_bar).split(",") if args.guess_bar is not None else [None]
    depths = str(args.depth).split(",") if args.depth is not None else [None]
    this = ["--tree", str(Path(args.this).resolve())] if args.this else []
    common = ["--worker", *this, *["--no-lookahead"] * args.no_lookahead, "--threads", str(args.threads), "--prompt",
              str(args.prompt), "--warmup", str(args.warmup), "--decode", str(args.decode), "--expert-precision",
              args.expert_precision, "--dtype", args.dtype]
    shares = {f"{s.strip()}": float(s.strip().rstrip("%")) / 100 for s in args.ram.split(",") if s.strip()}
    workers = {"resident": [me, *common, "--rows", str(counts[0]), "--io-threads", str(ios[0]), "--path", str(hf)]
               } if args.resident else {}
    if args.store_resident:
        workers["resident store"] = [me, *common, "--rows", str(counts[0]), "--io-threads", str(ios[0]), "--path",
                                     str(store), "--share", "0", "--warm"]
    for s, f in shares.items():  # several reader / row counts: each budget that reads (below 100%) with each
        for n in ios if f < 1 else ios[:1]:
            for rows in counts if f < 1 else counts[:1]:
                for bar, depth in [(b, d) for b in bars for d in depths] if f < 1 else [(None, None)]:
                    name = f"paged {s}" + (f" io{n}" if len(ios) > 1 and f < 1 else "") + \
                        (f" x{rows}" if len(counts) > 1 and f < 1 else "") + \
                        (f" bar{bar}" if len(bars) > 1 and f < 1 else "") + \
                        (f" depth{depth}" if len(depths) > 1 and f < 1 else "")
                    workers[name] = [me, *common, "--rows", str(rows), "--io-threads", str(n), "--path", str(store),
                                     "--share", str(f), *(["--guess-bar", bar] if bar is not None else []),
                                     *(["--depth", depth] if depth is not None else [])]
                    if args.base and f < 1:  # (argparse keeps the last --tree)
                        workers[name + " base"] = [*workers[name], "--tree", str(Path(args.base).resolve())]
    bandwidth: list[float] = []
    rows = f" for each of {args.rows} sequences in batched steps (figures per generated token)" if counts != [1] else ""
    print(f"{family} {size or 'small'} ({args.dtype} dense weights): {'resident vs ' * args.resident}paged "
          f"{', '.join(shares)} (LFRU, "
          f"O_DIRECT, prefetch){f', each reading budget also from {args.base}' if args.base else ''}, "
          f"{args.threads} compute threads, {args.prompt}-token prompt, {args.warmup} warm-up + {args.decode} timed "
          f"decode tokens{rows}, "
          f"{args.pairs} alternating rounds; load average {os.getloadavg()[0]:.1f}", flush=True)

    def show(r: int, res: dict) -> None:
        base = res.get("resident")
        line = [f"  round {r + 1} (O_DIRECT x{args.io_threads} {bandwidth[-1] / 1e9:.2f} GB/s)"]
        for name, v in res.items():
            vs = "" if base is None or v is base else \
                f" ({v['cpu'] / base['cpu']:.2f}x CPU, {v['wall'] / base['wall']:.2f}x wall)"
            line.append(f"{name} {v['cpu'] * 1e3:.1f} ms CPU {v['wall'] * 1e3:.1f} ms wall{vs}")
        print("; ".join(line), flush=True)

    res = alternate(workers, args.pairs, between=lambda: bandwidth.append(odirect_bandwidth(store, args.io_threads)),
                    show=show)
    # the baseline of the accounting: resident, else paged 100% (every expert in anonymous slab memory, no hooks)
    base_name = "resident" if "resident" in res else "paged 100%" if "paged 100%" in res else None
    base = res.get(base_name)
    bw = statistics.median(bandwidth)
    print(f"  O_DIRECT x{args.io_threads}: {bw / 1e9:.2f} GB/s (median of the rounds)" + ("" if base is None else
          f"; {base_name}: {statistics.median(r['cpu'] for r in base) * 1e3:.2f} ms CPU, "
          f"{statistics.median(r['wall'] for r in base) * 1e3:.2f} ms wall per token ({base[0]['path']})"))
    store_runs, full = res.get("resident store"), res.get("paged 100%")
    if store_runs and full:
        ratio = {key: [p[key] / r[key] for p, r in zip(full, store_runs)] for key in ("cpu", "thread", "wall")}
        print(f"  paged 100% / resident store (the store's maps, its experts read through the page cache first: "
              f"{statistics.median(r['cpu'] for r in store_runs) * 1e3:.2f} ms CPU, "
              f"{statistics.median(r['wall'] for r in store_runs) * 1e3:.2f} ms wall per token, "
              f"{store_runs[0]['path']}), per round: "
              + ", ".join(f"{key} {statistics.median(v):.2f}x ({' '.join(f'{x:.2f}' for x in v)})"
                          for key, v in ratio.items())
              + f"; greedy tokens equal: {all(_first(p['tokens']) == _first(r['tokens']) for p, r in zip(full, store_runs))}",
              flush=True)
    for name, runs in res.items():
        if name == base_name or "slots" not in runs[0]:  # (the resident store has no pager)
            continue

        def med(key, runs=runs):
            return statistics.median(r[key] for r in runs)

        roof = [r["missed"] / b / r["wall"] for r, b in zip(runs, bandwidth)]  # each round's own bandwidth
        print(f"  {name} ({runs[0]['slots']} slots, {runs[0].get('readers', '?')}, hit rate {med('hit_rate'):.1%}): CPU {med('cpu') * 1e3:.2f} ms, "
              f"compute thread {med('thread') * 1e3:.2f} ms, wall {med('wall') * 1e3:.2f} ms; per token: stall "
              f"{med('stall') * 1e3:.2f} ms, read {med('read') * 1e3:.2f} ms, lookup {med('lookup') * 1e3:.2f} ms, "
              f"paged MoE layers {med('moe') * 1e3:.2f} ms, missed {med('missed') / 1e6:.2f} MB "
              f"({med('misses'):.1f} experts), read {med('bytes_read') / 1e6:.2f} MB (lookahead precision "
              f"{med('precision'):.0%}, {med('wasted'):.1f} wasted"
              + (f", {med('issued'):.1f} guesses read, {med('late'):.1f} late" if "issued" in runs[0] else "")
              + (f"; distinct experts read / routed {med('distinct'):.3f}" if runs[0].get("distinct") else "")
              + f"); disk roofline {statistics.median(roof):.2f} "
              f"(missed bytes / the round's O_DIRECT bandwidth / wall per token; rounds "
              f"{' '.join(f'{x:.2f}' for x in roof)})"
              + (f"; reads in flight {med('read') / med('wall'):.0%} of the wall, at "
                 f"{statistics.median(r['bytes_read'] / r['read'] for r in runs if r['read'] > 0) / 1e9:.2f} GB/s "
                 f"(the disk's rate during the decode)" if any(r["read"] > 0 for r in runs) else ""))
        if base is None:
            continue
        same = all(_first(r["tokens"]) == _first(b["tokens"]) for r, b in zip(runs, base))
        extra = [r["wall"] - b["wall"] for r, b in zip(runs, base)]  # the same round's baseline
        pager_time = [r["stall"] + r["lookup"] for r in runs]
        explained = [t / e for t, e in zip(pager_time, extra) if e > 0]  # rounds with extra time to explain
        bound = [max(b["wall"], r["missed"] / w) / r["wall"] for r, b, w in zip(runs, base, bandwidth)]
        print(f"    vs {base_name}: CPU {statistics.median(r['cpu'] / b['cpu'] for r, b in zip(runs, base)):.2f}x, "
              f"compute thread {statistics.median(r['thread'] / b['thread'] for r, b in zip(runs, base)):.2f}x, wall "
              f"{statistics.median(r['wall'] / b['wall'] for r, b in zip(runs, base)):.2f}x; tiers' bound "
              f"max({base_name} wall, disk time) / wall {statistics.median(bound):.2f}; greedy tokens equal: {same}")
        print(f"    accounting: extra wall per token {statistics.median(extra) * 1e3:.2f} ms over {base_name} (rounds "
              f"{' '.join(f'{e * 1e3:.1f}' for e in extra)}); the compute thread waiting for reads (stall) + in the "
              f"pager (lookup) {statistics.median(pager_time) * 1e3:.2f} ms explain "
              + (f"{statistics.median(explained):.0%} of it (rounds with extra time: "
                 f"{' '.join(f'{x:.0%}' for x in explained)}; the rest: compute slowed by the I/O threads' CPU)"
                 if explained else "- (no round took longer than its baseline)"), flush=True)
        if runs[0].get("moe"):  # the paged layers ran through the fused step's callback: name the rest too
            path = [r["moe"] - r["stall"] - r["lookup"] - r.get("kernels", 0.0) for r in runs]
            named = [(r["stall"] + r["lookup"] + p) / e for r, p, e in zip(runs, path, extra) if e > 0]
            io = [r["io_cpu"] for r in runs if r.get("io_cpu") is not None]
            print(f"    where it goes, per token: stall {med('stall') * 1e3:.2f} ms + lookup {med('lookup') * 1e3:.2f} ms"
                  f" (of it the later layers' routers making the guesses {med('hint') * 1e3:.2f} ms, counted in "
                  f"lookup since session 12) + the paged layers' own path outside the fused step "
                  f"{statistics.median(path) * 1e3:.2f} ms (the callback's wall {med('moe') * 1e3:.2f} ms less stall, "
                  f"lookup and the experts' kernels {med('kernels') * 1e3:.2f} ms: its Python, the layer's router in "
                  f"torch, the held tables) explain "
                  + (f"{statistics.median(named):.0%} (rounds {' '.join(f'{x:.0%}' for x in named)})" if named else "-")
                  + f"; the rest {statistics.median(e - r['stall'] - r['lookup'] - p for r, p, e in zip(runs, path, extra)) * 1e3:.2f} ms"
                  f" is compute slowed by the readers"
                  + (f" (their CPU: {statistics.median(io) * 1e3:.2f} ms per token, "
                     f"{statistics.median(io) / med('bytes_read') * 1e9:.3f} ms per MB read; the share of it while "
                     f"compute ran, by the reads' time outside stalls: "
                     f"{statistics.median(r['io_cpu'] * max(0.0, r['read'] - r['stall']) / r['read'] for r in runs if r.get('io_cpu') is not None and r['read'] > 0) * 1e3:.2f} ms)"
                     if io else ""), flush=True)
    for name, runs in res.items():  # the A/B: this tree against the snapshot, round by round
        old = res.get(name + " base")
        if old is None:
            continue
        parts = []
        for key in ("cpu", "thread", "wall", "stall", "lookup"):
            ratios = [r[key] / o[key] for r, o in zip(runs, old) if o[key] > 0]
            parts.append(f"{key} {statistics.median(ratios):.2f}x ({' '.join(f'{x:.2f}' for x in ratios)})"
                         if ratios else f"{key} -")
        same = all(r["tokens"] == o["tokens"] for r, o in zip(runs, old))
        print(f"  {name} this tree / base, per round: {', '.join(parts)}; greedy tokens equal: {same}", flush=True)


if __name__ == "__main__":
    main()
