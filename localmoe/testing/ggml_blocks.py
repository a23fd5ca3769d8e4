"""Random GGUF quantised blocks for tests: every bit pattern of the codes, scales and mins of these
types (IQ4_NL / IQ4_XS included: any nibble is a level, any 6-bit scale valid) is a valid block, so tests draw the bytes directly (gguf's quantiser does not produce the
K-quants) and keep only the fp16 step fields finite and small."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# byte offsets of each block's fp16 fields: steps (d), and mins (Q4_1/Q5_1's m, the K-quants' dmin)
STEP_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,),
               Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,)}


def random_blocks(ggml_type, rows: int, cols: int, rng: np.random.Generator,
                  step: tuple[float, float] = (1e-3, 1e-2)) -> np.ndarray:
    """uint8 [rows, cols / block values * block bytes]: random blocks of `ggml_type` (a STEP_FIELDS
    type) with their fp16 fields drawn uniformly in `step` (finite, so every value is)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[ggml_type]
    if ggml_type not in STEP_FIELDS or cols % block_size:
        raise ValueError(f"random_blocks makes rows of whole blocks of {', '.join(t.name for t in STEP_FIELDS)}, "
                         f"not {ggml_type!r} x {cols}")
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    for offset in STEP_FIELDS[ggml_type]:
        d = rng.uniform(*step, (rows, cols // block_size)).astype(np.float16)
        blocks[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // block_size, 2)
    return blocks.reshape(rows, -1)
