"""Random GGUF K-quant blocks for tests: gguf's quantiser does not produce Q4_K / Q6_K, and every
bit pattern of their codes, scales and mins is a valid block, so tests draw the bytes directly."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
K_QUANT_STEPS = {Q.Q4_K: (0, 2), Q.Q6_K: (208,)}  # byte offsets of the fp16 steps (Q4_K: d, dmin; Q6_K: d)


def random_k_quant(ggml_type, rows: int, cols: int, rng: np.random.Generator,
                   step: tuple[float, float] = (1e-3, 1e-2)) -> np.ndarray:
    """uint8 [rows, cols / 256 * block bytes]: random super-blocks of `ggml_type` (Q4_K or Q6_K) with
    their fp16 steps drawn uniformly in `step` (finite, so every value is)."""
    if ggml_type not in K_QUANT_STEPS or cols % 256:
        raise ValueError(f"random_k_quant makes Q4_K / Q6_K rows of whole 256-value blocks, not {ggml_type!r} x {cols}")
    size = gguf.GGML_QUANT_SIZES[ggml_type][1]
    blocks = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for offset in K_QUANT_STEPS[ggml_type]:
        d = rng.uniform(*step, (rows, cols // 256)).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    return blocks.reshape(rows, -1)
