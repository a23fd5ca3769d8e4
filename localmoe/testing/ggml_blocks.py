"""Random GGUF quantised blocks for tests: every bit pattern of the codes, scales, grid indices and signs of
these types is a valid block (any nibble is a level, any 6-bit scale valid, every IQ grid index names a point),
so tests draw the bytes directly (gguf's quantiser does not produce the K-quants or the IQ types) and keep only
the fp16 step fields finite and small."""

from __future__ import annotations

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
# byte offsets of each block's fp16 fields: steps (d), and mins (Q4_1/Q5_1's m, the K-quants' dmin);
# IQ1_M spreads its d over the top nibbles of its four scale words (`set_f16`)
STEP_FIELDS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
               Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,), Q.IQ4_NL: (0,), Q.IQ4_XS: (0,),
               Q.IQ1_S: (0,), Q.IQ1_M: (48,), Q.IQ2_XXS: (0,), Q.IQ2_XS: (0,), Q.IQ2_S: (0,), Q.IQ3_XXS: (0,),
               Q.IQ3_S: (0,), Q.TQ1_0: (52,), Q.TQ2_0: (64,)}


def set_f16(blocks: np.ndarray, ggml_type, offset: int, values: np.ndarray) -> None:
    """Write float16 `values` [...] into the fp16 field at byte `offset` (a STEP_FIELDS entry) of each block of
    `blocks` uint8 [..., type_size]; for IQ1_M, into the top 4 bits of its scale words (d's bits 0-3 in word 0)."""
    bits = np.asarray(values, dtype=np.float16).view(np.uint16)
    if ggml_type == Q.IQ1_M:
        words = blocks[..., offset:offset + 8].copy().view(np.uint16)  # [..., 4]
        for k in range(4):
            words[..., k] = (words[..., k] & 0x0FFF) | (((bits >> (4 * k)) & 0xF) << 12)
        blocks[..., offset:offset + 8] = words.view(np.uint8)
        return
    blocks[..., offset:offset + 2] = bits[..., None].view(np.uint8)


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
        set_f16(blocks, ggml_type, offset, rng.uniform(*step, (rows, cols // block_size)))
    return blocks.reshape(rows, -1)
