"""benchmarks/gpu_check.sh and its Python parts, checked where no GPU is: the script parses, the GPU section
of benchmarks/kernels.py skips cleanly, and benchmarks/gpu_kernels.py runs every section end to end on tiny
shapes through the Triton interpreter (so the one run on a lent GPU does not die on a typo)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT / "benchmarks"))
    return subprocess.run(args, check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_gpu_check_script_parses():
    done = _run("bash", "-n", "benchmarks/gpu_check.sh")
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without CUDA")
def test_gpu_section_skips_without_cuda():
    done = _run(sys.executable, "benchmarks/kernels.py", "--gpu-only")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "GPU: skipped (needs CUDA and triton)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU stand-in of the GPU run")
def test_gpu_kernels_smoke_run():
    done = _run(sys.executable, "benchmarks/gpu_kernels.py", "--smoke")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = done.stdout.split("== SUMMARY")[-1]
    assert "FAILED" not in done.stdout, done.stdout[-3000:]
    for figure in ("copy bandwidth", "MXFP4 N=1 GEMV kernel alone", "MXFP4 N=16 call path time over bf16 bmm",
                   "kda recurrent T=1 per layer", "gdn chunk T=80 dispatcher time over fla's", "GEMV N=1 best swept tile"):
        assert figure in summary, f"{figure!r} missing from the summary:\n{summary}"
