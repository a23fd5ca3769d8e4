"""The MXFP4 Triton kernels compile for an H100/H200 (sm_90) here, without a GPU: Triton's own compiler and
ptxas, ahead of time, for every variant the dispatcher launches (GEMV tile heights, split K, the PTX decode
and its Triton-ops twin, tl.dot tiles in bf16 and fp32 with and without a masked K, the tile-table kernel).
A kernel that does not compile would otherwise first fail on the one GPU run. Also checks that the GEMV's
code loads stay 16-byte vectors (why it splits whole slices from a masked last one), and that the PTX decode
gives the codec's values for every code byte (its instructions emulated).

The compiles run in a child process: under TRITON_INTERPRET=1 (conftest) the kernels are interpreter
functions, which cannot be compiled.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys

import pytest

STRIDES = ("M", "O", "K", "stride_xm", "stride_pe", "stride_po", "stride_se", "stride_so", "stride_ym")


def _types(x: str, y: str) -> dict:
    return {"x_ptr": f"*{x}", "p_ptr": "*u8", "s_ptr": "*u8", "b_ptr": f"*{y}", "y_ptr": f"*{y}",
            "rows_ptr": "*i32", "sorted_ptr": "*i32", "tile_start_ptr": "*i32", "tile_expert_ptr": "*i32"}


def compile_sm90(fn, types: dict, consts: dict, div16=()) -> str:
    """PTX of jit function `fn` compiled for sm_90 (through ptxas); pointer arguments and `div16` ones
    specialised as the launcher does (divisible by 16), the other arguments i32."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    params = list(inspect.signature(fn.fn).parameters)
    sig = {p: "constexpr" if p in consts else types.get(p, "i32") for p in params}
    attrs = {(params.index(p),): [["tt.divisibility", 16]] for p in params
             if p not in consts and (sig[p].startswith("*") or p in div16)}
    src = ASTSource(fn=fn, signature=sig, constexprs={(params.index(p),): v for p, v in consts.items()}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]


def _variants():
    from localmoe.kernels.mxfp4_moe import triton as tk
    from localmoe.kernels.mxfp4_moe import triton_tiles as tt

    for rows in (1, 2, 4, 16):
        cfg = tk.gemv_config(32 * rows, 32, 3072, 3584, max_rows=16)
        for ptx in (True, False):
            yield f"gemv-N{rows}-{'ptx' if ptx else 'triton-ops'}", tk._gemv_kernel, _types("bf16", "bf16"), \
                {"HAS_BIAS": True, "PTX": ptx, **cfg}, STRIDES
    split = tk.gemv_config(1, 1, 64, 4096)
    yield "gemv-split-k-fp32", tk._gemv_kernel, _types("fp32", "fp32"), {"HAS_BIAS": False, "PTX": True, **split}, STRIDES
    for bf16 in (True, False):
        for even in (True, False):
            dtype = "bf16" if bf16 else "fp32"
            yield f"dot-{dtype}-{'even' if even else 'masked'}-K", tk._dot_kernel, _types(dtype, dtype), \
                {"HAS_BIAS": True, "BLOCK_M": 32, "BLOCK_O": 64, "BLOCK_K": 64, "BF16": bf16, "EVEN_K": even,
                 "PTX": True}, STRIDES
    yield "tile-tables", tt._plan_kernel, {"ids_ptr": "*i64", "rows_ptr": "*i32", "sorted_ids_ptr": "*i32",
                                           "scratch_ptr": "*i32", "tile_start_ptr": "*i32", "tile_expert_ptr": "*i32"}, \
        {"BLOCK_N": 1, "CHUNK": tt.CHUNK}, ()


def _compile_all() -> dict:
    """name -> {"error": str} or facts about its PTX."""
    out = {"_split_k": None}
    for name, fn, types, consts, div16 in _variants():
        out["_split_k"] = out["_split_k"] or (consts.get("SPLIT_K", 1) > 1 and consts["SPLIT_K"])
        try:
            ptx = compile_sm90(fn, types, consts, div16)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = {"error": f"{type(exc).__name__}: {exc}"[:3000]}
            continue
        out[name] = {"vector_loads": "ld.global.v4.b32" in ptx or "ld.global.nc.v4.b32" in ptx,
                     "ptx_decode": "0x4140" in ptx, "mma": "mma" in ptx, "barrier": "bar.sync" in ptx}
    return out


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton.backends.nvidia.compiler", reason="needs triton's NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900,
                          check=False)
    if "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("no ptxas in this triton")
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


NAMES = [f"gemv-N{n}-{d}" for n in (1, 2, 4, 16) for d in ("ptx", "triton-ops")] + \
    ["gemv-split-k-fp32"] + [f"dot-{t}-{k}-K" for t in ("bf16", "fp32") for k in ("even", "masked")] + ["tile-tables"]


@pytest.mark.parametrize("name", NAMES)
def test_compiles_for_sm90(compiled, name):
    facts = compiled[name]
    assert "error" not in facts, facts.get("error")
    if name.startswith("gemv"):
        assert facts["vector_loads"], "the GEMV's code loads are not 16-byte vectors"
        assert facts["ptx_decode"] == ("triton-ops" not in name)
    if name.startswith("dot"):
        assert facts["mma"] == ("bf16" in name)  # tensor cores for bf16 x only
    if name == "tile-tables":
        assert facts["barrier"]  # between writing the ranks and reading them
    assert compiled["_split_k"], "no variant exercised split K"


def _emulate_ptx(asm: str, word: int) -> list[int]:
    """Run _DECODE_PTX's prmt / shl / and / or on one 32-bit input ($4); returns $0..$3."""
    regs = {"$4": word}
    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, rest = line.split(None, 1)
        dst, *args = [a.strip() for a in rest.split(",")]
        a, b, *c = [regs[t] if t in regs else int(t, 0) for t in args]
        if op == "prmt.b32":  # byte i of the result = byte (selector nibble i) of {b, a}
            pool = [(a >> 8 * i) & 255 for i in range(4)] + [(b >> 8 * i) & 255 for i in range(4)]
            regs[dst] = sum(pool[(c[0] >> 4 * i) & 7] << 8 * i for i in range(4))
        elif op == "shl.b32":
            regs[dst] = (a << b) & 0xFFFFFFFF
        elif op == "and.b32":
            regs[dst] = a & b
        else:
            assert op == "or.b32", f"emulate {op}"
            regs[dst] = a | b
    return [regs[f"${i}"] for i in range(4)]


def test_ptx_decode_emulated_matches_the_codec():
    """Every code byte, in each of the 4 positions of the register: the fp16 patterns of its two nibbles are
    the codec's values times 2^-14, signs (and -0) included."""
    import torch
    from localmoe.kernels.mxfp4_moe import triton as tk

    from localmoe.quant.mxfp4 import dequantize

    asm = str(tk._DECODE_PTX.value if hasattr(tk._DECODE_PTX, "value") else tk._DECODE_PTX)
    codes = torch.arange(256, dtype=torch.uint8)
    want = dequantize(codes.view(16, 16), torch.full((16, 1), 127, dtype=torch.uint8)).view(256, 2) * 2.0 ** -14
    for shift in range(4):  # byte b at position shift, the other positions other bytes
        got = []
        for b in range(256):
            word = sum(((b + 37 * i) % 256 if i != shift else b) << 8 * i for i in range(4))
            out = _emulate_ptx(asm, word)
            halves = [(out[j // 2] >> 16 * (j % 2)) & 0xFFFF for j in range(4)]  # lo elements 0..3
            halves += [(out[2 + j // 2] >> 16 * (j % 2)) & 0xFFFF for j in range(4)]  # hi elements 0..3
            got.append([halves[shift], halves[4 + shift]])
        got = torch.tensor(got, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
        assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit()), f"byte position {shift}"


if __name__ == "__main__":
    print(json.dumps(_compile_all()))
