"""The CPU fast path: `mxfp4_cpu.cpp` (AVX2 + FMA), compiled on first use, loaded with ctypes.

The source has a plain C ABI and no torch headers, so it builds with gcc/clang alone in about a
second (a torch C++ extension took 2-3 minutes on the 2-core dev machine) and needs no ninja or
Python headers. The shared object is cached in `$LOCALMOE_CACHE` (default ~/.cache/localmoe)
under a hash of the source, flags and compiler, written atomically. Each call runs on
`torch.get_num_threads()` threads: the caller (ctypes releases the GIL) and the library's own
persistent workers take chunks of rows from a shared counter. A row is always computed whole by
one thread, so results do not depend on the thread count. (OpenMP inside the library, sharing
torch's libgomp, was measured first: its spin-waiting made 2 threads 6x slower than 1 on a shared
2-core machine; the Python thread pool used before split the rows statically, so a core busy
with another process held every call up.) Where the CPU lacks AVX2/FMA, no compiler is found
or the build fails, `library()` warns once and returns None and the dispatcher uses the reference.
`LOCALMOE_NO_CPU_KERNEL=1` disables it silently.

Why C++ and not torch: measured on a 2-core Zen 3 (docs/performance.md, "Kernels"), the
reference's dequantise (a gather per byte) + fp32 F.linear is far from memory bandwidth for
decode, and bf16 matmuls are slow without AVX512-BF16; decoding each 32-element block in
registers and using it at once streams the weights. For one token the GEMV splits x into integer
parts per 32-element block (int16 + int8, within ~2^-23 of the block's largest value) so that the
block dot products are integer multiply-adds (mxfp4_cpu.cpp); `dequantize` is exact.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("mxfp4_cpu.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17", "-pthread")
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
                lib.mxfp4_gemv_scratch.argtypes = (i64, i64)
                lib.mxfp4_gemv_scratch.restype = i64
                lib.mxfp4_gemv.argtypes = (ptr, i64, i64, ptr, ptr, i64, ptr, ptr, ctypes.c_int)
                lib.mxfp4_dequantize.argtypes = (ptr, ptr, i64, ptr, ctypes.c_int)
                lib.mxfp4_gemv.restype = lib.mxfp4_dequantize.restype = None
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                lib, reason = None, f"build failed ({e})"
        if reason:
            warnings.warn(f"localmoe: MXFP4 CPU kernel unavailable, using the torch reference: {reason}", stacklevel=2)
        _state["lib"] = lib
    return _state["lib"]


def _check(x: torch.Tensor | None, packed: torch.Tensor, scales: torch.Tensor) -> None:
    O, K = packed.shape[0], packed.shape[1] * 2
    assert packed.dtype == scales.dtype == torch.uint8 and packed.dim() == scales.dim() == 2, "uint8 codes, scales"
    assert K % 32 == 0 and tuple(scales.shape) == (O, K // 32), f"scales {tuple(scales.shape)}, codes [{O}, {K // 2}]"
    assert packed.is_contiguous() and scales.is_contiguous() and packed.device.type == "cpu"
    if x is not None:
        assert x.dtype == torch.float32 and x.dim() == 2 and x.shape[1] == K and x.is_contiguous(), "x: fp32 [N, K]"


def gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [N, K] fp32 -> x W^T [N, O] fp32, straight from MXFP4 (packed [O, K/2], scales [O, K/32]);
    the same bits for a token whatever N and the thread count."""
    x, packed, scales = x.contiguous(), packed.contiguous(), scales.contiguous()
    _check(x, packed, scales)
    N, K, O = x.shape[0], x.shape[1], packed.shape[0]
    lib, y = library(), x.new_empty(N, O)
    scratch = torch.empty(lib.mxfp4_gemv_scratch(N, K), dtype=torch.uint8)
    lib.mxfp4_gemv(x.data_ptr(), N, K, packed.data_ptr(), scales.data_ptr(), O, y.data_ptr(), scratch.data_ptr(),
                   torch.get_num_threads())
    return y


def dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """packed [O, K/2], scales [O, K/32] -> fp32 [O, K], equal to store.mxfp4.dequantize (-0 as +0)."""
    packed, scales = packed.contiguous(), scales.contiguous()
    _check(None, packed, scales)
    w = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
    library().mxfp4_dequantize(packed.data_ptr(), scales.data_ptr(), scales.numel(), w.data_ptr(),
                               torch.get_num_threads())
    return w
