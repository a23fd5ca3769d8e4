"""The localmoe CPU kernel library: every C++ kernel source, built into ONE shared object.

The sources (`SOURCES`: the MXFP4 expert GEMV, the dense fp32/bf16 GEMV) have a plain C ABI and
no torch headers, so they build with gcc/clang alone in a few seconds (a torch C++ extension took
2-3 minutes on the 2-core dev machine) and need no ninja or Python headers. They share one
persistent thread pool (pool.h): one library, one pool for the process, whichever kernels run.
The shared object is cached in `$LOCALMOE_CACHE` (default ~/.cache/localmoe) under a hash of the
sources, flags and compiler, written atomically. Each call runs on `torch.get_num_threads()`
threads: the caller (ctypes releases the GIL) and the pool's workers take chunks of rows from a
shared counter; a row is always computed whole by one thread, so results do not depend on the
thread count. Where the CPU lacks AVX2/FMA, no compiler is found or the build fails, `library()`
warns once and returns None and the dispatchers use torch. `LOCALMOE_NO_CPU_KERNEL=1` disables
it silently.
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

KERNELS = Path(__file__).resolve().parent.parent
HEADERS = (KERNELS / "_cpu" / "pool.h",)
SOURCES = (KERNELS / "mxfp4_moe" / "mxfp4_cpu.cpp", KERNELS / "dense_gemv" / "dense_cpu.cpp")
FLAGS = ("-O3", "-mavx2", "-mfma", "-fPIC", "-shared", "-std=c++17", "-pthread")

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
SIGNATURES = {  # name -> (argtypes, restype)
    "mxfp4_gemv_scratch": ((_i64, _i64), _i64),
    "mxfp4_gemv": ((_ptr, _i64, _i64, _ptr, _ptr, _i64, _ptr, _ptr, _int), None),
    "mxfp4_dequantize": ((_ptr, _ptr, _i64, _ptr, _int), None),
    "dense_gemv_f32": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int), None),
    "dense_gemv_bf16": ((_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr, _int), None),
}
_state: dict[str, object] = {}


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


def _build() -> Path:
    cxx = _compiler()
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False).stdout
    digest = hashlib.sha256(" ".join(FLAGS).encode() + version.encode())
    for path in HEADERS + SOURCES:
        digest.update(path.name.encode() + path.read_bytes())
    cache = Path(os.environ.get("LOCALMOE_CACHE", Path.home() / ".cache" / "localmoe")) / "kernels"
    target = cache / f"localmoe_cpu-{digest.hexdigest()[:16]}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / target.name
            cmd = [cxx, *FLAGS, f"-I{KERNELS / '_cpu'}", *map(str, SOURCES), "-o", str(out)]
            run = subprocess.run(cmd, capture_output=True, text=True, check=False)
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
                for name, (argtypes, restype) in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = argtypes, restype
            except (OSError, AttributeError, RuntimeError, subprocess.SubprocessError) as e:
                lib, reason = None, f"build failed ({e})"
        if reason:
            warnings.warn(f"localmoe: CPU kernels unavailable (MXFP4, dense GEMV), using torch: {reason}",
                          stacklevel=2)
        _state["lib"] = lib
    return _state["lib"]
