"""The localmoe CPU kernel library: every C++ kernel source, built into ONE shared object.

The sources (`SOURCES`: the MXFP4 expert GEMV, the fused MoE layer, the dense fp32/bf16 GEMV, dense
routed experts over a prefill chunk, GQA
decode attention (one sequence, or a batch of sequences over their paged caches) and the fused
attention decode step, residual add + RMSNorm, all layers of a GQA +
MoE, dense or hybrid (KDA / MLA, attention residuals, latent MoE) decode, GEMV from GGUF Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K blocks, a
decode token's routed experts from those blocks, the pager's reader threads) have a plain C ABI and no torch headers, so they
build with gcc/clang alone in a few seconds (a torch C++ extension took 2-3 minutes on the 2-core
dev machine) and need no ninja or Python headers. They share one persistent thread pool (pool.h):
one library, one pool for the process, whichever kernels run. The shared object is cached in
`localmoe.paths.cache_dir()`/kernels ($LOCALMOE_CACHE, else $XDG_CACHE_HOME/localmoe) under a hash of the sources, flags and compiler,
written atomically. Each call runs on `threads()` threads (`torch.get_num_threads()` unless
`small_steps` says otherwise): the caller (ctypes releases the GIL) and the pool's workers take
chunks of rows from a shared counter; a row is always computed whole by one thread, so results do
not depend on the thread count. Where the CPU lacks AVX2/FMA, no compiler is found or the build
fails, `library()` warns once and returns None and the dispatchers use torch.
`LOCALMOE_NO_CPU_KERNEL=1` disables it silently.

Instruction sets (`ISAS`): the same sources build for AVX2 + FMA, and where the CPU has AVX-512
(F, BW, VL) with VNNI (Zen 4, Ice Lake and later servers) also with those enabled: the integer dot
products of the MXFP4 kernels then run as vpdpbusd (mxfp4_rows.h). `isa()` picks the best the CPU
runs; `LOCALMOE_CPU_ISA=avx2` forces the baseline. Both give the same bits (tests/kernels check it
with `forced_isa`).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from localmoe.paths import cache_dir

KERNELS = Path(__file__).resolve().parent.parent
HEADERS = (KERNELS / "_cpu" / "pool.h", KERNELS / "_cpu" / "vec_math.h", KERNELS / "_cpu" / "glu.h",
           KERNELS / "_cpu" / "expert_rows.h",
           KERNELS / "_cpu" / "matrix.h", KERNELS / "mxfp4_moe" / "mxfp4_rows.h", KERNELS / "mxfp4_moe" / "mxfp4_q8.h",
           KERNELS / "mxfp4_moe" / "route.h",
           KERNELS / "dense_gemv" / "dense_rows.h", KERNELS / "dense_gemv" / "dense_tiles.h",
           KERNELS / "ggml_gemv" / "ggml_rows.h",
           KERNELS / "ggml_gemv" / "ggml_rows8_k.h", KERNELS / "ggml_gemv" / "ggml_rows8_q6k.h",
           KERNELS / "ggml_gemv" / "ggml_rows_iq4.h",
           KERNELS / "gqa_decode" / "gqa_heads.h", KERNELS / "gqa_decode" / "gqa_step.h", KERNELS / "decode_layers" / "hybrid_mixers.h",
           KERNELS / "fp8_cache" / "cache_rows.h",
           KERNELS / "paged_io" / "xxhash.h")
SOURCES = (KERNELS / "mxfp4_moe" / "mxfp4_cpu.cpp", KERNELS / "mxfp4_moe" / "moe_cpu.cpp",
           KERNELS / "dense_gemv" / "dense_cpu.cpp", KERNELS / "gqa_decode" / "gqa_cpu.cpp",
           KERNELS / "gqa_decode" / "paged_cpu.cpp", KERNELS / "gqa_decode" / "step_cpu.cpp",
           KERNELS / "rms_norm" / "norm_cpu.cpp",
           KERNELS / "decode_layers" / "layers_cpu.cpp", KERNELS / "ggml_gemv" / "ggml_cpu.cpp",
           KERNELS / "decode_layers" / "hybrid_cpu.cpp",
           KERNELS / "decode_layers" / "hybrid_prefill.cpp", KERNELS / "dense_moe" / "dense_moe_cpu.cpp",
           KERNELS / "ggml_gemv" / "ggml_moe_cpu.cpp", KERNELS / "paged_io" / "reader_cpu.cpp",
           KERNELS / "fp8_cache" / "fp8_cpu.cpp")
# Functions and loops on 64-byte boundaries: without it an edit to one kernel moves every kernel linked after it and
# their loops' alignment with it, ~1% on Kimi-Linear prefill's unchanged code (docs/performance.md, session 15).
FLAGS = ("-O3", "-mavx2", "-mfma", "-mf16c", "-fPIC", "-shared", "-std=c++17", "-pthread", "-falign-functions=64",
         "-falign-loops=64")
# ISA name -> (compiler flags added to FLAGS, /proc/cpuinfo flags the CPU must have), best last
ISAS = {"avx2": ((), ("avx2", "fma", "f16c")),
        "avx512vnni": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
                       ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"))}

_i64, _ptr, _int, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # name -> (argtypes, restype)
    "mxfp4_gemv_scratch": ((_i64, _i64, _int), _i64),
    "mxfp4_gemv": ((_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int, _int), None),
    "mxfp4_dequantize": ((_ptr, _ptr, _i64, _ptr, _int), None),
    "mxfp4_moe_scratch": ((_i64, _i64, _i64), _i64),
    "mxfp4_moe": ((_ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _int, _f32, _f32, _ptr, _ptr, _int,
                   _int), None),
    "mxfp4_route": ((_ptr, _i64, _ptr, _ptr, _ptr, _int, _int, _f32, _i64, _i64, _i64, _ptr, _ptr, _ptr, _int), None),
    "mxfp4_moe_routed_scratch": ((_i64, _i64, _i64, _i64, _i64), _i64),
    "mxfp4_moe_routed": ((_ptr, _i64, _ptr, _ptr, _ptr, _int, _int, _f32, _ptr, _i64, _i64, _i64, _i64, _ptr, _i64,
                          _int, _f32, _f32, _ptr, _ptr, _ptr, _ptr, _int, _int), None),
    "gqa_decode": ((_ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64,
                    _i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _int), None),
    "gqa_decode_paged": ((_ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _i64, _i64, _i64, _i64, _i64, _ptr, _ptr,
                          _f32, _ptr, _int), _i64),
    "gqa_step_scratch": ((_i64, _i64, _i64), _i64),
    "gqa_step": ((_ptr, _i64, _ptr, _int, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                  _ptr, _f32, _ptr, _ptr, _f32, _ptr, _int, _ptr, _ptr, _ptr, _int), None),
    "add_rms_norm": ((_ptr, _ptr, _ptr, _i64, _i64, _f32, _ptr), None),
    "decode_gqa_moe": ((_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _f32, _int, _ptr, _ptr, _ptr, _ptr, _ptr,
                        _ptr, _ptr, _int), _i64),
    "decode_gqa_moe_rows_work": ((_ptr, _i64), _i64),
    "decode_gqa_moe_rows": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _f32, _int, _i64, _ptr, _ptr,
                             _ptr, _ptr, _ptr, _ptr, _ptr, _int), _i64),
    "decode_dense_xq_bytes": ((_i64,), _i64),
    "decode_dense": ((_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _f32, _ptr, _ptr, _ptr, _ptr, _ptr, _int),
                     None),
    "decode_dense_rows_xq_bytes": ((_i64, _i64), _i64),
    "decode_dense_rows_work": ((_ptr, _i64), _i64),
    "decode_dense_rows": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _ptr, _i64, _ptr, _f32, _ptr, _ptr, _ptr, _ptr,
                           _int), _i64),
    "decode_hybrid_scratch": ((_ptr, _i64, _i64, _i64), _i64),
    "decode_hybrid": ((_ptr,), _int),
    "decode_hybrid_rows": ((_ptr, _ptr, _i64, _ptr, _i64, _ptr, _i64), _int),
    "dense_expert": ((_ptr, _ptr, _ptr, _ptr, _int, _f32, _f32, _f32, _ptr, _ptr, _ptr, _int), None),
    "delta_rule_tokens": ((_ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _int, _ptr, _int), None),
    "kda_chunk": ((_ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64,
                   _i64, _f32, _f32, _ptr, _int), None),
    "gdn_chunk": ((_ptr, _i64, _ptr, _i64, _i64, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32,
                   _ptr, _int), None),
    "mla_chunk": ((_ptr, _ptr, _i64, _i64, _i64, _i64, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64, _f32, _ptr, _int),
                  None),
    "dense_experts_token": ((_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _int, _f32, _f32, _ptr, _ptr, _ptr, _int),
                            None),
    "ggml_gemv_scratch": ((_i64, _i64), _i64),
    "ggml_gemv": ((_ptr, _i64, _i64, _ptr, _int, _i64, _ptr, _ptr, _ptr, _int, _int), _int),
    "ggml_dequantize_rows": ((_ptr, _i64, _ptr, _i64, _int, _i64, _ptr), _int),
    "ggml_repack": ((_ptr, _ptr, _i64, _i64, _int, _int, _ptr), _int),
    "ggml_moe_token_scratch": ((_i64, _i64, _i64), _i64),
    "ggml_moe_expert_scratch": ((_i64, _i64, _i64), _i64),
    "ggml_moe_expert": ((_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int, _f32, _f32, _ptr, _ptr, _int), _int),
    "ggml_moe_token": ((_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int, _f32, _f32, _ptr, _ptr, _int), _int),
    "ggml_moe_layer_scratch": ((_i64, _i64, _i64, _i64), _i64),
    "ggml_moe_layer": ((_ptr, _i64, _i64, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr, _ptr, _int, _f32, _f32, _ptr, _ptr,
                        _int), _int),
    "dense_moe_scratch": ((_i64, _i64, _i64), _i64),
    "dense_moe_expert": ((_ptr, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _ptr, _int, _i64, _int, _f32, _f32, _ptr, _ptr,
                          _int), None),
    "dense_moe_layer_scratch": ((_i64, _i64, _i64), _i64),
    "dense_moe_layer": ((_ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _ptr, _i64, _int, _i64, _int, _f32, _f32, _ptr, _ptr,
                         _int), None),
    "dense_gemv_f32": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int), None),
    "dense_gemv_bf16": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int), None),
    "dense_read": ((_ptr, _i64, _i64, _ptr, _int), None),
    "cache_rows_write": ((_ptr, _i64, _ptr), None),
    "cache_rows_read": ((_ptr, _i64, _i64, _i64, _ptr), None),
    "pio_open": ((_int,), _ptr),
    "pio_file": ((_ptr, _int, ctypes.c_char_p, _i64, _i64, _i64, _i64), _i64),
    "pio_submit": ((_ptr, _i64, _i64, _i64, _i64, _ptr, ctypes.c_uint64, _int, _int), None),
    "pio_cancel": ((_ptr, _i64), _int),
    "pio_wait": ((_ptr, _i64, ctypes.c_double), _int),
    "pio_wait_any": ((_ptr, ctypes.c_double), _int),
    "pio_reap": ((_ptr, _ptr, _i64), _i64),
    "pio_busy": ((_ptr,), ctypes.c_double),
    "pio_pause": ((_ptr, _int), None),
    "pio_close": ((_ptr, ctypes.c_double), _int),
}
_state: dict[str, object] = {}
_local = threading.local()  # .threads: this thread's kernel threads inside `small_steps`


def threads() -> int:
    """Threads a kernel call uses: `small_steps`' count inside it, else torch's."""
    return getattr(_local, "threads", 0) or torch.get_num_threads()


@contextmanager
def small_steps() -> Iterator[None]:
    """For a decode step: torch single-threaded, the library's kernels on all of torch's threads.

    A decode step is hundreds of tiny torch ops around a few large GEMVs. Measured on 2 cores
    (gpt-oss small): with torch on 2 threads each tiny op pays OpenMP's fork/join and its
    spinning helper fights the kernels' pool, and decode was slower than on 1 thread (16.2 vs
    14.5 ms/token); torch on 1 thread with the kernels on 2 took 12.3 ms.
    """
    n = torch.get_num_threads()
    if n == 1 or getattr(_local, "threads", 0):
        yield
        return
    _local.threads = n
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)
        _local.threads = 0


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _unsupported() -> str | None:
    """Why the library cannot run here, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    missing = [p.name for p in HEADERS + SOURCES if not p.exists()]
    if missing:
        return f"{', '.join(missing)} not installed"
    if _compiler() is None:
        return "no C++ compiler found (set CXX, or install g++)"
    return None


def _cpu_flags() -> set[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported_isas() -> list[str]:
    """The ISAS this CPU runs, baseline first (AVX2 is assumed where /proc/cpuinfo says nothing)."""
    flags = _cpu_flags()
    return ["avx2"] + [name for name, (_, need) in ISAS.items() if name != "avx2" and flags and set(need) <= flags]


def isa() -> str:
    """The ISA `library()` builds for: `LOCALMOE_CPU_ISA` if set, else the best this CPU runs."""
    forced = os.environ.get("LOCALMOE_CPU_ISA")
    if forced:
        if forced not in supported_isas():
            raise ValueError(f"LOCALMOE_CPU_ISA={forced}: this CPU runs {', '.join(supported_isas())}; "
                             "unset it or pick one of those")
        return forced
    return supported_isas()[-1]


def _load_best() -> ctypes.CDLL:
    """The library for `isa()`; where LOCALMOE_CPU_ISA names an ISA this CPU lacks, or a better ISA's
    build fails (an old compiler), the AVX2 one, with a warning."""
    try:
        name = isa()
    except ValueError as e:
        warnings.warn(f"localmoe: {e}; using the AVX2 kernels", stacklevel=3)
        name = "avx2"
    try:
        return _load(name)
    except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
        if name == "avx2":
            raise
        warnings.warn(f"localmoe: the {name} CPU kernels did not build ({e}); using the AVX2 ones", stacklevel=3)
        return _load("avx2")


def _sources() -> dict[str, bytes]:
    """Every header and source, by its path under kernels/: read once, so the library built is the one hashed."""
    return {path.relative_to(KERNELS).as_posix(): path.read_bytes() for path in HEADERS + SOURCES}


def _target(name: str, sources: dict[str, bytes]) -> Path:
    """Where the library for ISA `name` is cached: named by the compiler, its flags and every source's contents."""
    cxx = _compiler()
    flags = FLAGS + ISAS[name][0]
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(" ".join(flags).encode() + version.encode())
    for rel, data in sources.items():
        digest.update(Path(rel).name.encode() + data)
    return cache_dir() / "kernels" / f"localmoe_cpu-{name}-{digest.hexdigest()[:16]}.so"


@contextmanager
def _one_builder(target: Path, name: str) -> Iterator[None]:
    """Held while `target` is built: a process that finds another building the same library waits for it
    (then finds it built) instead of compiling it again beside it. Where file locks are unavailable (not
    POSIX), builds may run side by side; each renames its own result into place."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(target.with_name(target.name + ".lock"), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"localmoe: waiting for another process building the CPU kernels for {name}", file=sys.stderr,
                  flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _build(name: str) -> Path:
    """The cached library for ISA `name`, built first if needed. It is compiled from a copy of the sources made
    when they were hashed: a tree edited during the build (minutes on a loaded machine) cannot put other code
    under this hash."""
    sources = _sources()
    target = _target(name, sources)
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _one_builder(target, name):
        if target.exists():  # another process built it while this one waited
            return target
        print(f"localmoe: building the CPU kernels for {name} (first use of this version here: a few minutes)",
              file=sys.stderr, flush=True)
        cxx = _compiler()
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            tree = Path(tmp) / "kernels"  # the sources' own layout: their relative includes resolve in the copy
            for rel, data in sources.items():
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree / rel).write_bytes(data)
            out = Path(tmp) / target.name
            cmd = [cxx, *FLAGS, *ISAS[name][0], f"-I{tree / '_cpu'}",
                   *(str(tree / path.relative_to(KERNELS)) for path in SOURCES), "-o", str(out)]
            run = subprocess.run(cmd, capture_output=True, text=True, check=False)
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"{Path(cxx).name} exited with {run.returncode}: {last}")
            os.replace(out, target)
    return target


def _load(name: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_build(name)))
    lib.isa = name  # for describe()
    for entry, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(lib, entry)
        fn.argtypes, fn.restype = argtypes, restype
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernel library for `isa()`, or None where it is unavailable (warned once)."""
    if "lib" not in _state:
        lib, reason = None, None
        if os.environ.get("LOCALMOE_NO_CPU_KERNEL") == "1":
            reason = ""
        else:
            reason = _unsupported()
        if reason is None:
            try:
                lib = _load_best()
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
                lib, reason = None, f"build failed ({e})"
        if reason:
            warnings.warn(f"localmoe: CPU kernels unavailable (MXFP4, dense GEMV), using torch: {reason}",
                          stacklevel=2)
        _state["lib"] = lib
    return _state["lib"]


def describe() -> str:
    """One line for `localmoe run --stats`: the ISA the kernels run and their threads, or why torch runs."""
    if library() is None:
        reason = "LOCALMOE_NO_CPU_KERNEL=1" if os.environ.get("LOCALMOE_NO_CPU_KERNEL") == "1" else _unsupported()
        return f"off, torch runs ({reason or 'the build failed'})"
    return f"{_state['lib'].isa}, {threads()} threads"


@contextmanager
def forced_isa(name: str) -> Iterator[ctypes.CDLL]:
    """Every kernel call inside runs the library built for ISA `name` (one of `supported_isas()`):
    for tests that compare the ISAs' results. Not thread-safe: the library is swapped process-wide."""
    if name not in supported_isas():
        raise ValueError(f"ISA {name} does not run on this CPU ({', '.join(supported_isas())})")
    if library() is None:
        raise RuntimeError("the CPU kernel library is unavailable")
    key = f"lib-{name}"
    if key not in _state:
        _state[key] = _load(name)
    before = _state["lib"]
    _state["lib"] = _state[key]
    try:
        yield _state[key]
    finally:
        _state["lib"] = before
