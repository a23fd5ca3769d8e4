"""The lattice (IQ1/IQ2/IQ3) and ternary (TQ) dequantisers of quant/ggml_iq.py at the edges: extreme steps
(largest and smallest float16, subnormals, signed zeros, negative steps), all-minus and all-plus sign fields,
the last grid points, bit-exact against gguf's numpy dequantisers; the decoded grids against entries of
llama.cpp's tables (ggml-common.h) and the derived sign patterns against gguf's `ksigns`. Random blocks of
every type: tests/store/test_gguf.py."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T

from localmoe.quant import ggml_iq
from localmoe.quant.ggml import SUPPORTED_TYPES, dequantize
from localmoe.testing.ggml_blocks import STEP_FIELDS, set_f16

TYPES = list(ggml_iq.IQ_DECODERS)
# float16 steps at the edges: the largest, the smallest normal and subnormal, zeros, negatives
EXTREME_STEPS = np.array([65504.0, -65504.0, 6.1035e-05, 5.96e-08, -5.96e-08, 0.0, -0.0, 1.0, -0.00123],
                         dtype=np.float16)


def _reference(raw: np.ndarray, qtype: T) -> np.ndarray:
    return np.ascontiguousarray(gguf.quants.dequantize(raw, qtype), dtype=np.float32).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("fill", ["random", "zeros", "ones"])
def test_extreme_steps_and_signs_bit_exact(qtype, fill):
    """Every extreme step with random, all-zero and all-one code bytes (all-one: every sign minus, the top
    scale, the last grid points, IQ1's negative delta)."""
    rng = np.random.default_rng(int(qtype))
    type_size = GGML_QUANT_SIZES[qtype][1]
    n = len(EXTREME_STEPS)
    blocks = {"random": rng.integers(0, 256, (n, type_size), dtype=np.uint8),
              "zeros": np.zeros((n, type_size), dtype=np.uint8),
              "ones": np.full((n, type_size), 255, dtype=np.uint8)}[fill]
    for at in STEP_FIELDS[qtype]:
        set_f16(blocks, qtype, at, EXTREME_STEPS)
    want = _reference(blocks, qtype)
    assert np.isfinite(want).all()
    got = dequantize(torch.from_numpy(blocks), qtype, want.shape)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


# (type, point index, its values): entries of llama.cpp's uint64 / uint32 grids, least significant byte first
GRID_ENTRIES = [
    (T.IQ2_XXS, 1, 0x080808080808082B), (T.IQ2_XXS, 255, 0x2B2B2B1908081908),
    (T.IQ2_XS, 3, 0x0808080808082B08), (T.IQ2_XS, 511, 0x2B2B2B2B2B2B2B2B),
    (T.IQ2_S, 2, 0x0808080808081919), (T.IQ2_S, 1023, 0x2B2B2B2B2B2B2B2B),
    (T.IQ3_XXS, 5, 0x04040C3E), (T.IQ3_XXS, 255, 0x3E341C04),
    (T.IQ3_S, 3, 0x0101010B), (T.IQ3_S, 511, 0x0F0F0101),
    (T.IQ1_S, 1, 0xFFFFFFFFFFFFFF01), (T.IQ1_S, 2047, 0x0101010101010101),
]


@pytest.mark.parametrize(("qtype", "index", "packed"), GRID_ENTRIES, ids=lambda v: getattr(v, "name", str(v)))
def test_grid_points_equal_llama_cpp_tables(qtype, index, packed):
    points = ggml_iq.grid(qtype)
    size = points.shape[1]
    want = [int(b) for b in packed.to_bytes(size, "little")]
    if qtype == T.IQ1_S:
        want = [b - 256 if b > 127 else b for b in want]  # int8 levels -1, 0, 1
    assert points[index].tolist() == want
    assert torch.equal(ggml_iq.grid(T.IQ1_M), ggml_iq.grid(T.IQ1_S))


def test_sign_patterns_equal_ksigns():
    ksigns = np.frombuffer(gguf.quants.IQ2_XXS.ksigns, dtype=np.uint8)
    minus = (ksigns[:, None] >> np.arange(8)) & 1
    assert torch.equal(ggml_iq._SIGNS, torch.from_numpy(1.0 - 2.0 * minus.astype(np.float32)))


@pytest.mark.parametrize("qtype", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_stays_on_the_blocks_device(qtype):
    """Blocks on another device (a pager's GPU tier) are decoded there: every temporary and lookup table follows
    them (checked on the meta device, where a CPU tensor mixed in fails; values on CUDA below)."""
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    got = dequantize(torch.empty(3 * 2 * type_size, dtype=torch.uint8, device="meta"), qtype, (3, 2 * block_size))
    assert got.device.type == "meta" and got.shape == (3, 2 * block_size)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_dequantize_on_cuda_equals_cpu(qtype):
    rng = np.random.default_rng(int(qtype))
    blocks = rng.integers(0, 256, (64, GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8)
    for at in STEP_FIELDS[qtype]:
        set_f16(blocks, qtype, at, rng.uniform(-1e-2, 1e-2, 64))
    raw = torch.from_numpy(blocks)
    shape = (64, GGML_QUANT_SIZES[qtype][0])
    assert torch.equal(dequantize(raw.cuda(), qtype, shape).cpu(), dequantize(raw, qtype, shape))
