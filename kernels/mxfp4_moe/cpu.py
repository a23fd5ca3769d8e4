"""The CPU fast path: `mxfp4_cpu.cpp` (AVX2 + FMA, OpenMP), compiled on first use, loaded with ctypes.

The source has a plain C ABI and no torch headers, so it builds with gcc/clang alone in about a
second (a torch C++ extension took 2-3 minutes on the 2-core dev machine) and needs no ninja or
Python headers. The shared object is cached in `$LOCALMOE_CACHE` (default ~/.cache/localmoe)
under a hash of the source, flags and compiler, written atomically. The C code has no threads:
each call splits the rows into `torch.get_num_threads()` contiguous ranges, runs all but one on
a small thread pool and the last on the caller (ctypes releases the GIL). A row is always
computed whole by one thread, so results do not depend on the thread count. (OpenMP inside the
library, sharing torch's libgomp, was measured first: its spin-waiting made 2 threads 6x slower
than 1 on a shared 2-core machine.) Where the CPU lacks AVX2/FMA, no compiler is found or the
build fails, `library()` warns once and returns None and the dispatcher uses the reference.
`LOCALMOE_NO_CPU_KERNEL=1` disables it silently.

Why C++ and not torch: measured on a 2-core Zen 3 (docs/performance.md, "Kernels"), the
reference's dequantise (a gather per byte) + fp32 F.linear is far from memory bandwidth for
decode, and bf16 matmuls are slow without AVX512-BF16; decoding each 32-element block in
registers and using it at once streams the weights.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mxfp4_cpu.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17")
SPLIT_MIN_BYTES = 256 << 10  # below this much weight a call runs on one thread (a hand-off costs ~20 us)
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _unsupported() -> str | None:
    """Why the kernel cannot run here, or None."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return f"the CPU lacks AVX2 (torch reports {torch.backends.cpu.get_cpu_capability()})"
    if not SOURCE.exists():
        return f"{SOURCE.name} is not installed"
    if _compiler() is None:
        return "no C++ compiler found (set CXX, or install g++)"
    return None


def _build() -> Path:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    key = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS).encode() + version.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("LOCALMOE_CACHE", Path.home() / ".cache" / "localmoe")) / "kernels"
    target = cache / f"mxfp4_cpu-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / target.name
            run = subprocess.run([cxx, *FLAGS, str(SOURCE), "-o", str(out)], capture_output=True, text=True,
                                 check=False)
            if run.returncode != 0:
                last = (run.stderr.strip().splitlines() or ["?"])[-1]
                raise RuntimeError(f"{Path(cxx).name} exited with {run.returncode}: {last}")
            os.replace(out, target)
    return target


def library() -> ctypes.CDLL | None:
    """The loaded kernel library, or None where it is unavailable (warned once)."""
    if "lib" not in _state:
        lib, reason = None, None
        if os.environ.get("LOCALMOE_NO_CPU_KERNEL") == "1":
            reason = ""
        else:
            reason = _unsupported()
        if reason is None:
            try:
                lib = ctypes.CDLL(str(_build()))
                i64, ptr = ctypes.c_int64, ctypes.c_void_p
                lib.mxfp4_permute.argtypes = (ptr, i64, ptr)
                lib.mxfp4_gemv.argtypes = (ptr, i64, i64, ptr, ptr, i64, i64, i64, ptr)
                lib.mxfp4_dequantize.argtypes = (ptr, ptr, i64, i64, ptr)
                lib.mxfp4_permute.restype = lib.mxfp4_gemv.restype = lib.mxfp4_dequantize.restype = None
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                lib, reason = None, f"build failed ({e})"
        if reason:
            warnings.warn(f"localmoe: MXFP4 CPU kernel unavailable, using the torch reference: {reason}", stacklevel=2)
        _state["lib"] = lib
    return _state["lib"]


def _parallel(fn, total: int, nbytes: int, align: int = 8) -> None:
    """fn(begin, end) over [0, total) in torch.get_num_threads() contiguous ranges (multiples of align)."""
    threads = max(1, torch.get_num_threads())
    if threads == 1 or nbytes < SPLIT_MIN_BYTES or total < 2 * align:
        fn(0, total)
        return
    pool = _state.get("pool")
    if pool is None or pool._max_workers != threads - 1:
        pool = _state["pool"] = ThreadPoolExecutor(threads - 1, thread_name_prefix="localmoe-mxfp4")
    step = -(-total // threads // align) * align
    bounds = [(b, min(b + step, total)) for b in range(0, total, step)]
    futures = [pool.submit(fn, b, e) for b, e in bounds[:-1]]
    fn(*bounds[-1])
    for f in futures:
        f.result()


def _check(x: torch.Tensor | None, packed: torch.Tensor, scales: torch.Tensor) -> None:
    O, K = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == scales.dtype == torch.uint8 and packed.dim() == scales.dim() == 2, "uint8 codes, scales"
    assert K % 32 == 0 and tuple(scales.shape) == (O, K // 32), f"scales {tuple(scales.shape)}, codes [{O}, {K // 2}]"
    assert packed.is_contiguous() and scales.is_contiguous() and packed.device.type == "cpu"
    if x is not None:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == K and x.is_contiguous(), "x: fp32 [N, K]"


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [N, K] fp32 -> x W^T [N, O] fp32, straight from MXFP4 (packed [O, K/2], scales [O, K/32])."""
    x, packed, scales = x.contiguous(), packed.contiguous(), scales.contiguous()
    _check(x, packed, scales)
    N, K, O = x.shape[0], x.shape[1], packed.shape[0]
    lib, xp, y = library(), torch.empty_like(x), x.new_empty(N, O)
    lib.mxfp4_permute(x.data_ptr(), x.numel(), xp.data_ptr())
    args = (xp.data_ptr(), N, K, packed.data_ptr(), scales.data_ptr(), O)
    _parallel(lambda o0, o1: lib.mxfp4_gemv(*args, o0, o1, y.data_ptr()), O, packed.nbytes)
    return y


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed [O, K/2], scales [O, K/32] -> fp32 [O, K], equal to store.mxfp4.dequantize (-0 as +0)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    _check(None, packed, scales)
    w = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    lib = library()
    _parallel(lambda b0, b1: lib.mxfp4_dequantize(packed.data_ptr(), scales.data_ptr(), b0, b1, w.data_ptr()),
              scales.numel(), packed.nbytes, align=64)
    return w
